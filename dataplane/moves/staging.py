"""A ring of pinned block-sized buffers for moves between the device and the disk.

Files are read and written by the host, so device↔disk moves pass through host memory. The
ring lets the host read (or write) block i+1 while block i crosses PCIe: slot k is reused only
after the event of its previous copy completed. Its bytes are registered with the pinned
budget before they are allocated, like every other pinned buffer.
"""
from __future__ import annotations

import torch

from dataplane.moves.streams import CopyStreams, Done
from dataplane.pools.budget import PinnedBudget
from dataplane.pools.layout import KVLayout


class StagingRing:
    def __init__(self, budget: PinnedBudget, layout: KVLayout, num_slots: int, streams: CopyStreams,
                 owner: str = "staging-ring"):
        if num_slots < 1:
            raise ValueError(f"staging ring needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.streams = streams
        self.buffer = budget.alloc(owner, (num_slots, layout.block_words), torch.int32)
        self.rows = self.buffer.tensor
        self._events = [Done() for _ in range(num_slots)]

    def acquire(self, k: int) -> torch.Tensor:
        """Row k, once the copy that last used it has completed."""
        self._events[k].synchronize()
        self._events[k] = Done()
        return self.rows[k]

    def release_after(self, k: int, stream) -> None:
        """Row k is busy until the work now queued on ``stream`` completes."""
        self._events[k] = self.streams.mark(stream)

    def event(self, k: int):
        return self._events[k]

    def close(self) -> None:
        for e in self._events:
            e.synchronize()
        self.buffer.close()
