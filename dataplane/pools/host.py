"""The host pool: page-locked RAM sized by a byte budget, one KV block per slot.

Its buffer is allocated through the pinned budget (``PinnedBudget.alloc``), registered before it
is made. A GPU reaches it two ways: by DMA (cudaMemcpyAsync of whole blocks) and by kernels that
load/store the mapped pages directly (``kernels.gather`` / ``kernels.scatter``).

Each host copy remembers the checksum it was written under (computed on the device from the
source bytes, or read from a disk file's header). Checksums are carried, never recomputed from
the copy itself, so a copy corrupted while it sat here is caught when it is restored.
On CPU-only hosts the buffer is plain RAM (pin_memory needs CUDA); ``pinned`` says which.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import repeat

import torch

from residency.dataplane.pools.base import BlockPool
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.errors import IntegrityError, NotResident
from residency.dataplane.pools.layout import KVLayout


class HostPool(BlockPool):
    def __init__(self, layout: KVLayout, host_bytes: int, budget: PinnedBudget, owner: str = "host-pool"):
        num_slots = max(0, host_bytes // layout.block_bytes)
        self.buffer = budget.alloc(owner, (num_slots, layout.block_words), torch.int32)
        self.pinned = self.buffer.pinned
        self._checksums: dict[int, int] = {}
        super().__init__("host", layout, self.buffer.tensor)

    def checksum_of(self, block_id: int) -> int:
        """The checksum this copy was written under (READY or arriving)."""
        try:
            return self._checksums[block_id]
        except KeyError:
            raise NotResident("host", [block_id]) from None

    def checksums_of(self, block_ids: Iterable[int]) -> list[int]:
        cs = self._checksums
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        if not cs.keys() >= set(ids):
            raise NotResident("host", [b for b in ids if b not in cs])
        return list(map(cs.__getitem__, ids))

    def set_checksums(self, block_ids: Iterable[int], checksums: Iterable[int]) -> None:
        ids, sums = list(block_ids), list(checksums)
        if len(ids) != len(sums):
            raise IntegrityError(f"host: {len(ids)} blocks but {len(sums)} checksums")
        if not self.table._slot.keys() >= set(ids):
            raise NotResident("host", [b for b in ids if b not in self.table._slot])
        self._checksums.update(zip(ids, sums))

    def publish(self, block_ids: list[int]) -> None:
        if not self._checksums.keys() >= set(block_ids):
            missing = [b for b in block_ids if b not in self._checksums]
            raise IntegrityError(f"host: publishing blocks with no checksum recorded: {missing[:16]}")
        self.table.publish(block_ids)

    def cancel(self, block_ids: list[int]) -> None:
        self.table.cancel(block_ids)
        for b in block_ids:
            self._checksums.pop(b, None)

    def free(self, block_ids: Iterable[int]) -> int:
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        freed = self.table.free(ids)
        slot_map, cs = self.table._slot, self._checksums
        if slot_map.keys().isdisjoint(ids):         # the common case: every listed copy is gone
            deque(map(cs.pop, ids, repeat(None, len(ids))), maxlen=0)
        else:
            for b in ids:
                if b not in slot_map:
                    cs.pop(b, None)
        return freed

    def undrop_checksums(self, block_ids: list[int], checksums: list[int]) -> None:
        """Undo ``drop_checksums`` (a restore that freed its host copies early, then failed)."""
        self._checksums.update(zip(block_ids, checksums))

    def drop_checksums(self, block_ids: list[int]) -> None:
        """Forget the checksums of copies just freed through ``table.free_all_checked``."""
        deque(map(self._checksums.pop, block_ids, repeat(None, len(block_ids))), maxlen=0)

    def allocate(self, block_ids):  # a host copy without a checksum would be unverifiable
        raise NotImplementedError("host blocks arrive by reserve -> set_checksums -> publish")

    def check_integrity(self) -> None:
        super().check_integrity()
        held = set(self.table.ready_blocks()) | set(self.table.reserved_blocks())
        ready = set(self.table.ready_blocks())
        if not ready <= set(self._checksums) or not set(self._checksums) <= held:
            raise IntegrityError(
                f"host: {len(ready)} ready blocks, {len(self._checksums)} checksums, {len(held)} held; "
                f"missing {sorted(ready - set(self._checksums))[:16]}, "
                f"stale {sorted(set(self._checksums) - held)[:16]}")

    def close(self) -> None:
        self.buffer.close()
