"""BlockPool: a tier held as one table of equal slots, one KV block per slot.

The pool's bytes are seen by the copy and checksum kernels as ``words``: an int32 table
``[num_slots, block_words]`` whose row s is slot s. Which block is in which slot, and whether
it can be read, is the ``SlotTable``'s business; this class only binds the two together.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from residency.dataplane.pools.errors import IntegrityError
from residency.dataplane.pools.layout import KVLayout
from residency.dataplane.pools.slots import SlotTable


class BlockPool:
    tier: str

    def __init__(self, tier: str, layout: KVLayout, words: torch.Tensor):
        if words.dim() != 2 or words.shape[1] != layout.block_words or words.dtype != torch.int32:
            raise IntegrityError(
                f"{tier}: words must be int32 [slots, {layout.block_words}], got {words.dtype} {tuple(words.shape)}")
        self.tier = tier
        self.layout = layout
        self.words = words
        self.table = SlotTable(tier, words.shape[0], layout.block_bytes)

    # ------------------------------------------------------------ queries
    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def capacity_bytes(self) -> int:
        return self.table.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.table.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.table.free_bytes

    def has(self, block_id: int) -> bool:
        return self.table.has(block_id)

    def holds(self, block_id: int) -> bool:
        """READY or arriving (RESERVED) here."""
        return self.table.holds(block_id)

    def not_ready(self, block_ids: Iterable[int]) -> list[int]:
        """The listed blocks not READY here."""
        return self.table.not_ready(block_ids)

    def held(self, block_ids: Iterable[int]) -> list[int]:
        """The listed blocks READY or arriving here."""
        return self.table.held(block_ids)

    def room_for(self, n: int):
        """The NoRoom ``reserve`` would raise for n new blocks, or None. Pure."""
        return self.table.room_for(n)

    def slot_of(self, block_id: int) -> int:
        """Slot of a READY block (raises NotResident / BlockNotReady)."""
        return self.table.slot_of(block_id)

    def slots_of(self, block_ids: Iterable[int]) -> list[int]:
        return self.table.slots_of(block_ids)

    def blocks(self) -> list[int]:
        return self.table.ready_blocks()

    # ------------------------------------------------------------ mutations
    def allocate(self, block_ids: Iterable[int]) -> list[int]:
        """Slots for new blocks the caller writes itself; readable at once. Raises NoRoom/AlreadyResident."""
        return self.table.allocate(block_ids)

    def reserve(self, block_ids: Iterable[int]) -> list[int]:
        """Slots for blocks that are about to arrive; not readable until ``publish``."""
        return self.table.reserve(block_ids)

    def publish(self, block_ids: list[int]) -> None:
        self.table.publish(block_ids)

    def cancel(self, block_ids: list[int]) -> None:
        """Drop reservations: the pool is as if they never happened."""
        self.table.cancel(block_ids)

    def incref(self, block_ids: Iterable[int]) -> None:
        self.table.incref(block_ids)

    def free(self, block_ids: Iterable[int]) -> int:
        """Drop a reference per block; returns bytes actually freed (0 for blocks still held)."""
        return self.table.free(block_ids)

    def check_integrity(self) -> None:
        self.table.check_integrity()
