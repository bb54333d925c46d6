"""The device KV pool: ONE tensor per model, block-first (see ``layout.py`` for the picture).

    tensor : [num_blocks, num_layers, 2, page_tokens, num_kv_heads, head_dim]
    words  : tensor.view(num_blocks, block_words) as int32   (what moves and checksums see)

The model runner builds block tables from logical ids with ``slot_of`` / ``block_table`` and
reads ``tensor[slots, layer, 0|1]``. A block that a restore is still bringing in has a slot but
is not READY, so ``slot_of`` refuses it (``BlockNotReady``) until its copy completed on the
device and its checksum matched.

On a CPU-only host the same class holds the tensor in RAM: identical semantics, so everything
above it (moves, mover, tests) runs unchanged in CI.

The pool can be resized live (``resize``): every resize makes a new generation (``gen``), and the
pool's readers (dataplane/pools/readers.py) must each bind to it before anyone may use the pool
again. ``stamps`` is what each reader carries; ``behind()`` names those that do not carry ``gen``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from residency.dataplane.pools.base import BlockPool
from residency.dataplane.pools.errors import IntegrityError, ResizeRefused, TornPool
from residency.dataplane.pools.layout import KVLayout
from residency.dataplane.pools.memory import FreeMemory, measure_free_memory


@dataclass(frozen=True)
class Resized:
    """What a resize did and measured. ``*_freed_bytes``: free after less free before (a grow is
    negative); None where there is nothing honest to read (the driver's count on a CPU host)."""

    from_gen: int
    to_gen: int
    from_slots: int
    to_slots: int
    from_bytes: int
    to_bytes: int
    blocks_relocated: int
    allocator_freed_bytes: int | None
    measured_freed_bytes: int | None


class DevicePool(BlockPool):
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        tensor = torch.empty(layout.pool_shape(num_blocks), dtype=layout.dtype, device=self.device)
        super().__init__("device", layout, self._words_of(tensor, layout))
        self.tensor = tensor
        self.gen = 0
        self.readers: dict[str, object] = {}      # name -> reader (readers.PoolReader)
        self.stamps: dict[str, int] = {}          # name -> the generation it carries

    @staticmethod
    def _words_of(tensor: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        return tensor.view(tensor.shape[0], layout.block_numel).view(torch.int32)

    # ------------------------------------------------------------ generations and readers
    def add_reader(self, reader) -> None:
        """Register a reader and bind it to the current generation (raises ReaderRefused: not added)."""
        if reader.name in self.readers:
            raise IntegrityError(f"device pool: a reader named {reader.name!r} is already registered")
        reader.bind(self, self.gen)
        self.readers[reader.name] = reader

    def stamp(self, reader: str, gen: int) -> None:
        """A reader now carries ``gen`` (called by its ``bind``)."""
        self.stamps[reader] = gen

    def behind(self) -> dict[str, int]:
        """Readers that do not carry the pool's generation, with the one they carry (-1: never bound)."""
        return {r: self.stamps.get(r, -1) for r in self.readers if self.stamps.get(r, -1) != self.gen}

    def check_usable(self, user: str) -> None:
        """Raise TornPool (naming the readers behind) unless every reader carries ``gen``."""
        behind = self.behind()
        if behind:
            raise TornPool(self.tier, self.gen, behind, user)

    # ------------------------------------------------------------ resize
    def resize_refusal(self, num_slots: int, free: FreeMemory | None = None):
        """(plan, None) if ``resize(num_slots)`` can go ahead, else (None, ResizeRefused). Pure but
        for reading the machine's free memory (``free``: a reading to use instead)."""
        plan = self.table.plan_resize(num_slots)
        if isinstance(plan, ResizeRefused):
            return None, plan
        if num_slots == self.num_slots:
            return plan, None
        need = num_slots * self.layout.block_bytes
        free = free if free is not None else measure_free_memory(self.device)
        if need > free.bytes:
            return None, ResizeRefused(
                self.tier, f"the new tensor of {num_slots} x {self.layout.block_bytes} B = {need} B does not fit in "
                f"{free.bytes} B free ({free.source}); the old one ({self.capacity_bytes} B) is held until the copy "
                "is done", asked_slots=num_slots, asked_bytes=need, live_blocks=self.table.num_ready,
                available_bytes=free.bytes)
        return plan, None

    def resize(self, num_slots: int, to_gen: int | None = None, free: FreeMemory | None = None,
               then: Callable[[], None] | None = None) -> Resized:
        """Make the pool ``num_slots`` long, as generation ``to_gen`` (default: the next one).

        Raises ResizeRefused (nothing changed) while a move is in flight, when the live blocks do
        not fit, when the machine cannot hold the new tensor, or when ``to_gen`` does not move
        forward. Then: blocks in slots past the new end are copied (on the device) into free
        slots below it, a new tensor is made, the kept range copied into it, the old one dropped,
        and what the allocator and the driver count free is read before and after.

        NOTE: peak memory during a resize is the old tensor plus the new one (the copy needs
        both); a shrink on a card with less free than the new size is refused, not attempted.
        The same size is a rebind in place: no copy, a new generation only.

        After it every reader is behind until it binds to the new generation (``check_usable``).
        ``then()`` runs after the swap and before the "after" reading: the rebind of the readers, so
        that the old tensor they held is let go before it is counted (a reader that keeps it, e.g.
        one that missed its stamp, keeps its bytes counted as not freed: that is what happened)."""
        to_gen = self.gen + 1 if to_gen is None else to_gen
        held = self.table.num_ready + self.table.num_reserved
        if to_gen <= self.gen:
            raise ResizeRefused(self.tier, f"to_gen {to_gen} does not move forward from gen {self.gen}",
                                asked_slots=num_slots, asked_bytes=num_slots * self.layout.block_bytes,
                                live_blocks=held)
        plan, refused = self.resize_refusal(num_slots, free)
        if refused is not None:
            raise refused
        from_gen, from_slots, from_bytes = self.gen, self.num_slots, self.capacity_bytes
        cuda = self.device.type == "cuda"
        before = _counters(self.device) if cuda else None
        if num_slots != from_slots:
            if plan.blocks:          # disjoint rows: every dst < num_slots <= every src
                dst = torch.tensor(plan.dst, dtype=torch.long, device=self.device)
                src = torch.tensor(plan.src, dtype=torch.long, device=self.device)
                self.words.index_copy_(0, dst, self.words.index_select(0, src))
            try:      # the relocated rows only filled free slots: a failure here changes nothing
                new = torch.empty(self.layout.pool_shape(num_slots), dtype=self.layout.dtype, device=self.device)
            except (RuntimeError, MemoryError) as e:     # torch.OutOfMemoryError is a RuntimeError
                raise ResizeRefused(self.tier, f"the new tensor could not be allocated: {e}", asked_slots=num_slots,
                                    asked_bytes=num_slots * self.layout.block_bytes, live_blocks=held) from e
            keep = min(num_slots, from_slots)
            if keep:
                new[:keep].copy_(self.tensor[:keep])
            self.tensor, self.words = new, self._words_of(new, self.layout)
            del new
            self.table.resize(plan)
        self.gen = to_gen
        if then is not None:
            then()
        alloc_freed = driver_freed = None
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            after = _counters(self.device)
            alloc_freed = before[0] - after[0]
            driver_freed = after[1] - before[1]
        return Resized(from_gen, to_gen, from_slots, num_slots, from_bytes, self.capacity_bytes,
                       len(plan.blocks), alloc_freed, driver_freed)

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.words.shape[0] != self.table.num_slots or self.tensor.shape[0] != self.table.num_slots:
            raise IntegrityError(f"device pool: tensor {self.tensor.shape[0]} rows, words {self.words.shape[0]}, "
                                 f"table {self.table.num_slots} slots")
        if self.words.data_ptr() != self.tensor.data_ptr():
            raise IntegrityError("device pool: words is not a view of the tensor")

    def block_table(self, block_ids: Iterable[int]) -> torch.Tensor:
        """Slots of READY blocks as an int32 tensor on the pool's device (for attention kernels)."""
        return torch.tensor(self.slots_of(block_ids), dtype=torch.int32, device=self.device)

    def block_view(self, block_id: int) -> torch.Tensor:
        """The block's ``[num_layers, 2, page_tokens, num_kv_heads, head_dim]`` view (READY only)."""
        return self.tensor[self.slot_of(block_id)]


def _counters(device: torch.device) -> tuple[int, int]:
    """(bytes the caching allocator holds, bytes the driver counts free) on a CUDA device."""
    torch.cuda.synchronize(device)
    return torch.cuda.memory_reserved(device), torch.cuda.mem_get_info(device)[0]
