"""Slot lists to device index tensors, through budgeted pinned scratch.

Kernels need their slot lists on the device. Copying a pageable Python list would make the
host wait for the whole copy stream (pageable transfers are synchronous), stalling the pipeline,
and ``pin_memory()`` would pin outside the budget. So each stream owns one ``IndexUploader``: a
pinned int64 scratch registered with the pinned budget, split in two halves used in turn; a half
is rewritten only after the event of its previous upload (on the same stream) has completed.
On CPU the same scratch is plain memory and the "upload" is a copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from dataplane.moves.streams import CopyStreams, Done
from dataplane.pools.budget import PinnedBudget


class IndexUploader:
    def __init__(self, budget: PinnedBudget, owner: str, capacity: int, streams: CopyStreams):
        self.capacity = capacity
        self.streams = streams
        self.buffer = budget.alloc(owner, (2, capacity), torch.int64)
        self._events = [Done(), Done()]
        self._turn = 0

    def upload(self, stream, *lists: Sequence[int]) -> list[torch.Tensor]:
        """Enqueue the lists' upload on ``stream``; returns one int64 device tensor per list."""
        total = sum(len(x) for x in lists)
        if total > self.capacity:
            raise ValueError(f"index upload of {total} entries exceeds scratch capacity {self.capacity}")
        half = self._turn
        self._turn ^= 1
        self._events[half].synchronize()
        host = self.buffer.tensor[half]
        out, at = [], 0
        for x in lists:
            host[at : at + len(x)] = torch.as_tensor(x, dtype=torch.int64)
            at += len(x)
        if not self.streams.cuda:
            dev = host[:total].clone()
        else:
            with self.streams.on(stream):
                dev = host[:total].to(self.streams.device, non_blocking=True)
            self._events[half] = self.streams.mark(stream)
        at = 0
        for x in lists:
            out.append(dev[at : at + len(x)])
            at += len(x)
        return out

    def close(self) -> None:
        for e in self._events:
            e.synchronize()
        self.buffer.close()
