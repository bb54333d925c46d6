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

from residency.dataplane.moves.streams import CopyStreams, Done
from residency.dataplane.pools.budget import PinnedBudget
from residency.kernels.gather import gather_blocks_trusted


class SumsLanding:
    """Where a move's checksums come home: a pinned int64 row registered with the budget.

    ``land(sums, at, after)`` enqueues the store of the device checksums into ``row[at:]`` with a
    kernel on the small stream (SM stores over PCIe: no copy engine, so it never waits behind a
    move's chunks), after the event ``after``; ``Landed.read()`` waits for it and returns them as
    ints in [0, 2^64). A move may land several parts at once at different offsets (the head of a
    restore while its last chunk crosses, and its tail). Used only from the mover's thread, and
    read back before the move returns, so one row serves every move.
    """

    def __init__(self, budget: PinnedBudget, capacity: int, streams: CopyStreams):
        self.capacity = capacity
        self.streams = streams
        self.budget = budget
        self.buffer = budget.alloc("checksum-landing", (max(1, capacity),), torch.int64)

    def regrow(self, capacity: int) -> None:
        """Room for ``capacity`` checksums (a grown pool's moves can land more). The old row is
        let go first, so the budget needs only the new one; a refusal (PinnedBudgetExceeded)
        leaves a row of the old capacity. Only between moves: nothing may be landing."""
        old = self.capacity
        self.buffer.close()
        try:
            self.buffer = self.budget.alloc("checksum-landing", (max(1, capacity),), torch.int64)
            self.capacity = capacity
        except BaseException:
            self.buffer = self.budget.alloc("checksum-landing", (max(1, old),), torch.int64)
            raise

    def land(self, sums: torch.Tensor, at: int = 0, after=None, spin: bool = False) -> Landed:
        n = sums.numel()
        if at + n > self.capacity:
            raise ValueError(f"{at + n} checksums exceed the landing row's {self.capacity}")
        s = self.streams
        if n == 0 or not s.cuda:
            return Landed(sums.view(torch.int64).tolist() if n else [], None, None)
        row = self.buffer.tensor[at : at + n]
        if after is not None:
            s.wait_event(s.small, after)
        with s.on(s.small):
            gather_blocks_trusted(sums.view(torch.int64).view(1, n), s.zero_index, row.view(1, n))
        return Landed(None, s.mark(s.small, spin), row)

    def fetch(self, sums: torch.Tensor, after=None) -> list[int]:
        return self.land(sums, 0, after).read()

    def close(self) -> None:
        self.buffer.close()


class Landed:
    """Checksums on their way into the landing row; ``read()`` waits and returns them."""

    __slots__ = ("vals", "event", "row")

    def __init__(self, vals, event, row):
        self.vals, self.event, self.row = vals, event, row

    def read(self) -> list[int]:
        if self.vals is None:
            self.event.synchronize()
            self.vals = self.row.tolist()
        return [v & 0xFFFFFFFFFFFFFFFF for v in self.vals]


class IndexUploader:
    def __init__(self, budget: PinnedBudget, owner: str, capacity: int, streams: CopyStreams):
        self.capacity = capacity
        self.streams = streams
        self.budget, self.owner = budget, owner
        self.buffer = budget.alloc(owner, (2, capacity), torch.int64)
        # The halves as numpy arrays over the same pinned bytes: a list of ints is written into
        # them by numpy's assignment (one C loop), not by a torch tensor built and then copied
        # through torch's indexing (~15 µs more host time per list).
        self._rows = self.buffer.tensor.numpy()
        self._events = [Done(), Done()]
        self._turn = 0

    def regrow(self, capacity: int) -> None:
        """Room for ``capacity`` entries per upload (a grown pool). Waits for the uploads in
        flight, lets the old scratch go, then registers and pins the new one; a refusal
        (PinnedBudgetExceeded) leaves a scratch of the old capacity."""
        for e in self._events:
            e.synchronize()
        old = self.capacity
        self.buffer.close()
        try:
            self.buffer = self.budget.alloc(self.owner, (2, capacity), torch.int64)
            self.capacity = capacity
        except BaseException:
            self.buffer = self.budget.alloc(self.owner, (2, old), torch.int64)
            raise
        finally:
            self._rows = self.buffer.tensor.numpy()
            self._events = [Done(), Done()]

    def upload(self, stream, *lists: Sequence[int]) -> list[torch.Tensor]:
        """Enqueue the lists' upload on ``stream``; returns one int64 device tensor per list."""
        total = sum(len(x) for x in lists)
        if total > self.capacity:
            raise ValueError(f"index upload of {total} entries exceeds scratch capacity {self.capacity}")
        half = self._turn
        self._turn ^= 1
        self._events[half].synchronize()
        host, rows = self.buffer.tensor[half], self._rows[half]
        out, at = [], 0
        for x in lists:
            rows[at : at + len(x)] = x
            at += len(x)
        if not self.streams.cuda:
            dev = host[:total].clone()
        else:
            # NOTE: a kernel reads the pinned rows (SM loads over PCIe), not a DMA: an H2D DMA
            # would wait on the copy engine behind whatever chunks a restore has queued there.
            with self.streams.on(stream):
                dev = torch.empty(total, dtype=torch.int64, device=self.streams.device)
                if total:
                    gather_blocks_trusted(host[:total].view(1, total), self.streams.zero_index, dev.view(1, total))
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
