"""Blocks made, adopted and released outside a move (the mover's thread only).

``commit_blocks`` fills new blocks with seeded random words (test and bench data, and the
warm-up); ``adopt_blocks`` reports device blocks the model runner allocated and wrote;
``release`` drops copies on one tier, all or nothing. None of them touches a block that a move
in flight holds (``BlockBusy``).
"""
from __future__ import annotations

import torch

from collections.abc import Mapping

from residency.dataplane.pools import AlreadyResident, BlockBusy, DataPlaneError
from residency.dataplane.tiers import Tiers
from residency.events.commands import BlocksReleased, BlocksWritten, CommitBlocks, ReleaseBlocks
from residency.kernels.checksum import block_checksums, checksums_to_ints


class BlockOps:
    """``commit_blocks`` / ``adopt_blocks`` / ``release`` on ``tiers``; ``busy`` maps each block a
    move in flight holds to its move (the mover's, read here, never written)."""

    def __init__(self, tiers: Tiers, busy: Mapping[int, str], worker: int):
        self.tiers = tiers
        self.busy = busy
        self.worker = worker
        self.layout = tiers.layout

    def commit_blocks(self, cmd: CommitBlocks) -> BlocksWritten:
        """New blocks on ``cmd.tier`` filled with random words seeded by ``cmd.seed``.

        Raises AlreadyResident / NoRoom / BlockBusy (nothing changed); the process shell answers
        those with an ErrorReply. Keys are "" (test data has no content key).
        """
        ids = list(cmd.blocks)
        if len(set(ids)) != len(ids):
            raise AlreadyResident(cmd.tier, [b for b in ids if ids.count(b) > 1])
        self._check_not_busy(cmd.tier, ids)
        if cmd.tier == "device":
            self.tiers.device_pool.check_usable("a block commit")     # raises TornPool
        pool = self.tiers.pool(cmd.tier)
        present = [b for b in ids if pool.holds(b)]
        if present:
            raise AlreadyResident(cmd.tier, present)
        refused = pool.room_for(len(ids))
        if refused is not None:
            raise refused
        gen_dev = self.tiers.torch_device if cmd.tier == "device" else torch.device("cpu")
        data = seeded_words(cmd.seed, len(ids), self.layout.block_words, gen_dev)
        if cmd.tier == "device":
            slots = self.tiers.device_pool.allocate(ids)
            self.tiers.device_pool.words.index_copy_(0, torch.tensor(slots, device=gen_dev), data)
        else:
            sums = checksums_to_ints(block_checksums(data, range(len(ids)), ids))
            if cmd.tier == "host":
                slots = self.tiers.host_pool.reserve(ids)
                self.tiers.host_pool.words.index_copy_(0, torch.tensor(slots), data)
                self.tiers.host_pool.set_checksums(ids, sums)
                self.tiers.host_pool.publish(ids)
            else:
                self.tiers.disk_tier.reserve(ids)
                try:
                    for i, b in enumerate(ids):
                        self.tiers.disk_tier.write(b, data[i], sums[i])
                    self.tiers.disk_tier.publish(ids)
                except BaseException:
                    self.tiers.disk_tier.cancel(ids)
                    raise
        return BlocksWritten(request_id=cmd.request_id, worker=self.worker, tier=cmd.tier, blocks=ids,
                             bytes=len(ids) * self.layout.block_bytes, keys=[""] * len(ids))

    def adopt_blocks(self, request_id: str, block_ids: list[int], keys: list[str] | None = None) -> BlocksWritten:
        """Report device blocks the model runner allocated (``device_pool.allocate``) and wrote."""
        slots_ok = self.tiers.device_pool.slots_of(block_ids)  # raises NotResident / BlockNotReady
        keys = list(keys) if keys is not None else [""] * len(block_ids)
        if len(keys) != len(slots_ok):
            raise DataPlaneError(f"adopt_blocks: {len(block_ids)} blocks but {len(keys)} keys")
        return BlocksWritten(request_id=request_id, worker=self.worker, tier="device", blocks=list(block_ids),
                             bytes=len(block_ids) * self.layout.block_bytes, keys=keys)

    def release(self, cmd: ReleaseBlocks) -> BlocksReleased:
        """Drop the named copies on one tier; ``bytes_freed`` is what the pool actually freed.

        All-or-nothing: raises NotResident or BlockBusy (nothing freed) if any block cannot go.
        """
        ids = list(cmd.blocks)
        self._check_not_busy(cmd.tier, ids)
        freed = self.tiers.pool(cmd.tier).free(ids)
        return BlocksReleased(release_id=cmd.release_id, worker=self.worker, tier=cmd.tier, blocks=ids,
                              bytes_freed=freed)

    def _check_not_busy(self, tier: str, ids: list[int]) -> None:
        busy = [b for b in ids if b in self.busy]
        if busy:
            raise BlockBusy(tier, busy)


def seeded_words(seed: int, num_blocks: int, block_words: int, device: torch.device) -> torch.Tensor:
    """Random int32 words over the full range, reproducible from ``seed`` on a given device."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (num_blocks, block_words), dtype=torch.int32, device=device, generator=g)
