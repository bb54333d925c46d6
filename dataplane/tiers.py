"""The memory of one data-plane worker: its three tiers and the pinned scratch its moves use.

    device pool   KV blocks in device memory (the tensor the model reads and writes)
    host pool     pinned host slots
    disk tier     one file per block, rebuilt (and verified) from the directory at start
    scratch       copy streams, slot-index upload buffers, the device<->disk staging ring and
                  the landing row where checksums come home

NOTE: the pinned budget is the only way pinned memory is made in a worker; every buffer here
registers before it allocates, and a refusal raises with its arithmetic. ``pinned_bytes_needed``
is the same arithmetic, for the caller that sizes the budget.
"""
from __future__ import annotations

import os

import torch

from residency.dataplane.moves import CopyStreams, IndexUploader, StagingRing, SumsLanding
from residency.dataplane.pools import DevicePool, DiskTier, HostPool, IntegrityError, KVLayout, PinnedBudget
from residency.dataplane.pools.budget import page_round
from residency.kernels.checksum import block_checksums, checksums_to_ints

# Block-sized pinned buffers of the device<->disk staging ring: the host reads (or writes) one
# block while the ring's previous one crosses PCIe.
STAGING_RING_SLOTS = 4

TIERS = ("device", "host", "disk")


class Tiers:
    def __init__(self, layout: KVLayout, device_blocks: int, host_bytes: int, disk_dir: str | os.PathLike,
                 pinned_budget_bytes: int, device: torch.device, *, disk_bytes: int | None, fsync: bool):
        self.layout = layout
        self.torch_device = device
        self.pinned = PinnedBudget(pinned_budget_bytes, pin=device.type == "cuda")
        self._closers: list = []
        try:
            self.device_pool = DevicePool(layout, device_blocks, device)
            self.host_pool = HostPool(layout, host_bytes, self.pinned)
            self._closers.append(self.host_pool)
            self.streams = CopyStreams(device)
            max_blocks = max(device_blocks, self.host_pool.num_slots, 1)
            self.indexes = {}
            for d in ("d2h", "h2d", "hash"):
                self.indexes[d] = IndexUploader(self.pinned, f"index-{d}", 2 * max_blocks, self.streams)
                self._closers.append(self.indexes[d])
            self.ring = StagingRing(self.pinned, layout, STAGING_RING_SLOTS, self.streams)
            self._closers.append(self.ring)
            self.landing = SumsLanding(self.pinned, max_blocks, self.streams)
            self._closers.append(self.landing)
        except BaseException:
            self.close()
            raise
        self.disk_tier = DiskTier(disk_dir, layout, disk_bytes, fsync=fsync)
        self.disk_report = self.disk_tier.rebuild(verify=self._hash_disk_payload)

    @staticmethod
    def pinned_bytes_needed(layout: KVLayout, device_blocks: int, host_bytes: int) -> int:
        """The pinned budget these arguments register (host pool, staging ring, index scratch, landing)."""
        host_slots = host_bytes // layout.block_bytes
        max_blocks = max(device_blocks, host_slots, 1)
        return (page_round(max(host_slots * layout.block_bytes, 1))
                + page_round(STAGING_RING_SLOTS * layout.block_bytes)
                + 3 * page_round(2 * 2 * max_blocks * 8)
                + page_round(max_blocks * 8))

    def scratch_capacity(self, device_slots: int) -> int:
        """Blocks the index scratch and the landing row must hold for a device pool of this size."""
        return max(device_slots, self.host_pool.num_slots, 1)

    def scratch_growth_bytes(self, device_slots: int) -> int:
        """Pinned bytes the scratch would add for a device pool of ``device_slots`` (0: it fits)."""
        need = self.scratch_capacity(device_slots)
        grow = 0
        for up in self.indexes.values():            # each [2 halves, 2 lists x need] int64
            if 2 * need > up.capacity:
                grow += page_round(2 * 2 * need * 8) - up.buffer.footprint_bytes
        if need > self.landing.capacity:
            grow += page_round(need * 8) - self.landing.buffer.footprint_bytes
        return max(0, grow)

    def grow_index_scratch(self, device_slots: int) -> None:
        """Grow the slot-index uploaders for a device pool of ``device_slots`` (never shrinks:
        they cost little and a later grow would pin them again). Raises PinnedBudgetExceeded."""
        need = self.scratch_capacity(device_slots)
        for up in self.indexes.values():
            if 2 * need > up.capacity:
                up.regrow(2 * need)

    def grow_landing(self, device_slots: int) -> None:
        """Grow the checksum landing row for a device pool of ``device_slots`` (never shrinks)."""
        need = self.scratch_capacity(device_slots)
        if need > self.landing.capacity:
            self.landing.regrow(need)

    def pool(self, tier: str):
        return {"device": self.device_pool, "host": self.host_pool, "disk": self.disk_tier}[tier]

    def capacities(self) -> dict[str, int]:
        return {t: self.pool(t).capacity_bytes for t in TIERS}

    def usage(self) -> dict[str, int]:
        """Bytes taken on each tier, including slots reserved by moves in flight."""
        return {t: self.pool(t).used_bytes for t in TIERS}

    def _hash_disk_payload(self, block_id: int, words: torch.Tensor) -> int:
        row = words.view(1, -1)
        if self.torch_device.type == "cuda":
            row = row.to(self.torch_device)
        return checksums_to_ints(block_checksums(row, [0], [block_id]))[0]

    def check_integrity(self) -> None:
        """Raise IntegrityError with the numbers if a pool, or the pinned budget's account of
        the buffers made here, is broken."""
        for t in TIERS:
            self.pool(t).check_integrity()
        self.pinned.check_integrity()
        grants = {g.grant_id: g for g in self.pinned.grants()}
        unregistered = [(c.buffer.owner, c.buffer.footprint_bytes) for c in self._closers
                        if grants.get(c.buffer.grant.grant_id) != c.buffer.grant
                        or c.buffer.grant.bytes != c.buffer.footprint_bytes]
        if unregistered:
            raise IntegrityError(f"pinned: buffers not registered as they are with the budget: {unregistered}")

    def close(self) -> None:
        """Unpin and release every pinned buffer (the caller has finished its moves)."""
        while self._closers:
            self._closers.pop().close()
