"""A ring of pinned block-sized buffers for moves between the device and the disk.

Files are read and written by the host, so device↔disk moves pass through host memory. The
ring lets the host read (or write) block i+1 while block i crosses PCIe: slot k is reused only
after the event of its previous copy completed. Its bytes are registered with the pinned
budget before they are allocated, like every other pinned buffer.
"""
from __future__ import annotations

import threading

import torch

from residency.dataplane.moves.streams import CopyStreams, Done
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.layout import KVLayout


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
        # NOTE: held by whoever uses the rows: the mover's thread for a plain disk move, the reader
        # thread of a restore from disk that lands layer by layer (moves/layered_disk.py), which
        # runs beside the mover's thread; a disk move begun meanwhile waits for the ring
        self.lock = threading.Lock()

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


class DeviceStaging:
    """Two device buffers per direction for the "staged" copy mode, used in turn.

    A buffer is refilled only after the event of the last operation that read it (the DMA out of
    it, or the scatter out of it) completed on the device, so chunk k+1 is gathered while chunk k
    crosses PCIe. Device memory, not pinned: it is outside the pinned budget and allocated on
    first use (2 × pipeline_blocks × block_bytes per direction: 256 MiB for 2 MiB blocks, 64 per chunk).
    """

    def __init__(self, layout: KVLayout, blocks_per_buffer: int, device: torch.device):
        self.layout = layout
        self.rows = max(1, blocks_per_buffer)
        self.device = device
        self._bufs: dict[str, list[torch.Tensor]] = {}
        self.free: dict[str, list] = {"d2h": [Done(), Done()], "h2d": [Done(), Done()]}
        self.turn = {"d2h": 0, "h2d": 0}

    def take(self, direction: str) -> tuple[int, torch.Tensor]:
        if direction not in self._bufs:
            self._bufs[direction] = [
                torch.empty((self.rows, self.layout.block_words), dtype=torch.int32, device=self.device)
                for _ in range(2)
            ]
        i = self.turn[direction]
        self.turn[direction] ^= 1
        return i, self._bufs[direction][i]

    @property
    def device_bytes(self) -> int:
        return sum(b.numel() * 4 for bufs in self._bufs.values() for b in bufs)
