"""SlotTable: which logical block lives in which slot of one tier, and in what state.

A tier (device pool, host pool) is a fixed array of equal slots. Each slot is in one state:

    FREE ──reserve──► RESERVED ──publish──► READY (refcount ≥ 1) ──free (last ref)──► FREE
                         │                                          ▲
                         └───────────────cancel─────────────────────┘ (to FREE)

RESERVED slots hold bytes that are still arriving (a restore before its checksum verified):
they count as used for room, but ``slot_of`` refuses them, so no reader can see a block before
its copy finished and verified. Refcounts count holders of a READY block (the residency itself
is the first; the model runner may ``incref`` while a step reads it). A slot returns to the
free list only when its last holder lets go.

Free slots are handed out lowest-first: successive allocations on a fresh pool get consecutive
slots, which lets DMA copies coalesce into fewer, longer runs. The free list is a plain list,
sorted lazily before slots are taken, so a 1024-block move costs a few bulk dict/set updates
rather than 1024 heap operations (moves run at PCIe speed; their bookkeeping must not show).
Every mutation is all-or-nothing: it validates every block first and raises without changing
anything.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat

from residency.dataplane.pools.errors import (
    AlreadyResident,
    BlockNotReady,
    IntegrityError,
    NoRoom,
    NotResident,
    ResizeRefused,
)


@dataclass(frozen=True)
class Relocation:
    """How a table becomes ``num_slots`` long: each listed block leaves slot ``src[i]`` (at or past
    the new end) for the free slot ``dst[i]`` below it. A grow relocates nothing.

        shrink to 4:   slots  0  1  2  3 | 4  5  6
                              a  .  b  . | .  c  d        c: 5 -> 1,  d: 6 -> 3
    """

    from_slots: int
    num_slots: int
    blocks: tuple[int, ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]


def _as_set(ids: Iterable[int]) -> set | frozenset:
    return ids if isinstance(ids, (set, frozenset)) else set(ids)


def _zeros(n: int):
    return repeat(0, n)


class SlotTable:
    def __init__(self, tier: str, num_slots: int, slot_bytes: int):
        if num_slots < 0:
            raise ValueError(f"{tier}: num_slots must be >= 0, got {num_slots}")
        self.tier = tier
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free: list[int] = list(range(num_slots))
        self._free_sorted = True
        self._slot: dict[int, int] = {}        # block_id -> slot (READY and RESERVED)
        self._block: dict[int, int] = {}       # slot -> block_id
        self._refs: dict[int, int] = {}        # block_id -> refcount (READY only)
        self._reserved: set[int] = set()       # block_ids RESERVED

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_ready(self) -> int:
        return len(self._refs)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def free_bytes(self) -> int:
        return self.num_free * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes in READY and RESERVED slots (a reserved slot is taken, even if not yet readable)."""
        return (self.num_slots - self.num_free) * self.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def has(self, block_id: int) -> bool:
        """READY here (readable)."""
        return block_id in self._refs

    def holds(self, block_id: int) -> bool:
        """READY or RESERVED here."""
        return block_id in self._slot

    # NOTE: the bulk queries below run on every block of every move (1024 blocks for a 2 GiB
    # spill); each first answers "none" with one C-level set operation and walks the list in
    # Python only to name the offenders.
    def not_ready(self, block_ids: Iterable[int]) -> list[int]:
        """The listed blocks that are not READY here (bulk ``not has``)."""
        refs = self._refs
        if refs.keys() >= _as_set(block_ids):
            return []
        return [b for b in block_ids if b not in refs]

    def held(self, block_ids: Iterable[int]) -> list[int]:
        """The listed blocks that are READY or RESERVED here (bulk ``holds``)."""
        m = self._slot
        if m.keys().isdisjoint(block_ids):
            return []
        return [b for b in block_ids if b in m]

    def shared(self, block_ids: Iterable[int]) -> list[int]:
        """The listed blocks with more than one holder."""
        refs = self._refs
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        if not ids or max(map(refs.get, ids, _zeros(len(ids)))) <= 1:
            return []
        return [b for b in ids if refs.get(b, 0) > 1]

    def is_reserved(self, block_id: int) -> bool:
        return block_id in self._reserved

    def slot_of(self, block_id: int) -> int:
        """The slot of a READY block; raises NotResident, or BlockNotReady while it is arriving."""
        if block_id in self._refs:
            return self._slot[block_id]
        if block_id in self._reserved:
            raise BlockNotReady(self.tier, [block_id])
        raise NotResident(self.tier, [block_id])

    def slots_of(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        missing = self.not_ready(ids)
        if missing:
            arriving = [b for b in missing if b in self._reserved]
            if arriving and len(arriving) == len(missing):
                raise BlockNotReady(self.tier, arriving)
            raise NotResident(self.tier, missing)
        return list(map(self._slot.__getitem__, ids))

    def reserved_slot(self, block_id: int) -> int:
        if block_id not in self._reserved:
            raise NotResident(self.tier, [block_id])
        return self._slot[block_id]

    def refcount(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def ready_blocks(self) -> list[int]:
        return sorted(self._refs)

    def reserved_blocks(self) -> list[int]:
        return sorted(self._reserved)

    def room_for(self, n: int) -> NoRoom | None:
        """The refusal ``reserve`` would raise for n new blocks, or None. Pure."""
        if n > self.num_free:
            return NoRoom(
                self.tier, n * self.slot_bytes, self.free_bytes,
                f"{n} blocks × {self.slot_bytes} B > {self.num_free} free slots × {self.slot_bytes} B",
            )
        return None

    def plan_resize(self, num_slots: int) -> Relocation | ResizeRefused:
        """Where each block past a new end ``num_slots`` would go, or the refusal with its
        arithmetic. Pure. Refused while any slot is RESERVED (a move is in flight: its bytes would
        land in a slot that may not survive), and when the blocks held do not fit: the worker
        never drops a block, the caller moves them out first."""
        asked = num_slots * self.slot_bytes
        held = len(self._slot)
        if num_slots < 0:
            return ResizeRefused(self.tier, f"num_slots must be >= 0, got {num_slots}", asked_slots=num_slots,
                                 asked_bytes=asked, live_blocks=held)
        if self._reserved:
            return ResizeRefused(
                self.tier, f"{len(self._reserved)} blocks are arriving (a move in flight): "
                f"{sorted(self._reserved)[:8]}", asked_slots=num_slots, asked_bytes=asked, live_blocks=held)
        if held > num_slots:
            return ResizeRefused(
                self.tier, f"{held} live blocks do not fit in {num_slots} slots: {held - num_slots} over "
                f"({held} x {self.slot_bytes} B = {held * self.slot_bytes} B held > {asked} B asked); "
                "move them out first", asked_slots=num_slots, asked_bytes=asked, live_blocks=held)
        outside = sorted(s for s in self._block if s >= num_slots)
        holes = sorted(s for s in self._free if s < num_slots)[:len(outside)]
        return Relocation(self.num_slots, num_slots, tuple(self._block[s] for s in outside), tuple(outside),
                          tuple(holes))

    # ------------------------------------------------------------ mutations
    def resize(self, plan: Relocation) -> None:
        """Apply ``plan_resize``'s plan (the caller has copied the relocated blocks' bytes from
        ``src`` to ``dst``): blocks keep their state and refcounts, only their slots change."""
        if plan.from_slots != self.num_slots or self._reserved:
            raise IntegrityError(f"{self.tier}: resize plan made for {plan.from_slots} slots applied to "
                                 f"{self.num_slots} with {len(self._reserved)} reserved")
        for b, src, dst in zip(plan.blocks, plan.src, plan.dst):
            if self._slot.get(b) != src or dst in self._block or dst >= plan.num_slots:
                raise IntegrityError(f"{self.tier}: stale resize plan: block {b} {src} -> {dst}")
        for b, src, dst in zip(plan.blocks, plan.src, plan.dst):
            del self._block[src]
            self._block[dst] = b
            self._slot[b] = dst
        n = plan.num_slots
        self._free = [s for s in range(n) if s not in self._block]
        self._free_sorted = True
        self.num_slots = n

    def reserve(self, block_ids: Iterable[int]) -> list[int]:
        """Take a slot for each new block, not yet readable. Raises AlreadyResident, NoRoom."""
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        self._check_new(ids)
        slots = self.claim(len(ids))
        self._record_reserved(ids, slots)
        return slots

    # A move that must start its copy at once splits ``reserve`` in two: ``claim`` takes the slots
    # off the free list (a slice: the copy can target them now), ``record_reserved`` writes the
    # per-block maps while the first bytes cross. Nothing else touches the table in between (the
    # mover's one thread); ``unclaim`` gives claimed slots back if the move fails first.
    def claim(self, n: int) -> list[int]:
        """The n lowest free slots, taken but not yet assigned to blocks. Raises NoRoom."""
        refused = self.room_for(n)
        if refused is not None:
            raise refused
        if not self._free_sorted:
            self._free.sort()
            self._free_sorted = True
        slots = self._free[:n]
        del self._free[:n]
        return slots

    def record_reserved(self, block_ids: list[int], slots: list[int]) -> None:
        """Assign claimed ``slots`` to new blocks, RESERVED. Raises AlreadyResident (nothing recorded)."""
        if len(block_ids) != len(slots):
            raise IntegrityError(f"{self.tier}: {len(block_ids)} blocks for {len(slots)} claimed slots")
        self._check_new(block_ids)
        self._record_reserved(block_ids, slots)

    def unclaim(self, slots: list[int]) -> None:
        """Give back slots from ``claim`` that were never recorded."""
        self._free.extend(slots)
        self._free_sorted = False

    def _record_reserved(self, ids: list[int], slots: list[int]) -> None:
        self._slot.update(zip(ids, slots))
        self._block.update(zip(slots, ids))
        self._reserved.update(ids)

    def publish(self, block_ids: Iterable[int]) -> None:
        """RESERVED -> READY with refcount 1: from now on readers may see the bytes."""
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        if not self._reserved.issuperset(ids):
            raise NotResident(self.tier, [b for b in ids if b not in self._reserved])
        self._reserved.difference_update(ids)
        self._refs.update(dict.fromkeys(ids, 1))

    def cancel(self, block_ids: Iterable[int]) -> None:
        """RESERVED -> FREE: the arriving bytes are dropped, as if the reservation never happened."""
        ids = list(block_ids)
        if not self._reserved.issuperset(ids):
            raise NotResident(self.tier, [b for b in ids if b not in self._reserved])
        self._reserved.difference_update(ids)
        self._release_slots(ids)

    def allocate(self, block_ids: Iterable[int]) -> list[int]:
        """Reserve and publish at once (the writer fills the slots itself). Raises like reserve."""
        ids = list(block_ids)
        slots = self.reserve(ids)
        self.publish(ids)
        return slots

    # ------------------------------------------------------------ checked-ahead commits
    # A move checks its commit while its copy is still crossing the link, then applies it the
    # moment the bytes land, without checking again: the mover runs on one thread, so nothing
    # can touch the table in between. Each ``*_checked`` call requires its ``can_*`` to have
    # returned True with no mutation since. A move may even apply them while its last chunk is
    # still crossing (no other code runs before it returns, and it returns only after landing);
    # the ``un*_checked`` calls undo them exactly if that wait fails or the last checksums differ.
    def can_free_all(self, block_ids: list[int]) -> bool:
        """Whether ``free(block_ids)`` would free every listed slot (READY, distinct, one holder). Pure."""
        refs = self._refs
        return (bool(block_ids) and refs.keys() >= set(block_ids) and len(set(block_ids)) == len(block_ids)
                and max(map(refs.__getitem__, block_ids)) == 1)

    def free_all_checked(self, block_ids: list[int]) -> int:
        deque(map(self._refs.__delitem__, block_ids), maxlen=0)
        self._release_slots(block_ids)
        return len(block_ids) * self.slot_bytes

    def unfree_checked(self, block_ids: list[int], slots: list[int]) -> None:
        """Undo ``free_all_checked(block_ids)`` with nothing in between: each block back in its
        slot (``slots``, in the same order) with one holder. A move that applied its commit
        before its last bytes landed calls this when the wait fails."""
        n = len(slots)
        if self._free[len(self._free) - n:] != slots:
            raise IntegrityError(f"{self.tier}: unfree of {n} slots that are not the last freed")
        del self._free[len(self._free) - n:]
        self._slot.update(zip(block_ids, slots))
        self._block.update(zip(slots, block_ids))
        self._refs.update(dict.fromkeys(block_ids, 1))

    def can_publish(self, block_ids: list[int]) -> bool:
        """Whether ``publish(block_ids)`` would succeed (every block RESERVED). Pure."""
        return self._reserved.issuperset(block_ids)

    def publish_checked(self, block_ids: list[int]) -> None:
        self._reserved.difference_update(block_ids)
        self._refs.update(dict.fromkeys(block_ids, 1))

    def unpublish_checked(self, block_ids: list[int]) -> None:
        """Undo ``publish_checked(block_ids)`` with nothing in between: READY -> RESERVED."""
        deque(map(self._refs.__delitem__, block_ids), maxlen=0)
        self._reserved.update(block_ids)

    def incref(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        bad = [b for b in ids if b not in self._refs]
        if bad:
            raise NotResident(self.tier, bad)
        for b in ids:
            self._refs[b] += 1

    def free(self, block_ids: Iterable[int]) -> int:
        """Drop one reference per listed block; returns the bytes whose slots became free.

        All-or-nothing: raises NotResident (nothing changed) if any block is not READY here.
        A block listed twice drops two references.
        """
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        refs = self._refs
        unique = set(ids)
        if not refs.keys() >= unique:
            raise NotResident(self.tier, [b for b in ids if b not in refs])
        if not ids:
            return 0
        if len(unique) == len(ids) and max(map(refs.__getitem__, ids)) == 1:
            deque(map(refs.__delitem__, ids), maxlen=0)   # the common case: every block's last reference
            self._release_slots(ids)
            return len(ids) * self.slot_bytes
        need: dict[int, int] = {}
        for b in ids:
            need[b] = need.get(b, 0) + 1
        over = [b for b, k in need.items() if k > refs[b]]
        if over:
            raise NotResident(self.tier, over)
        gone = []
        for b, k in need.items():
            refs[b] -= k
            if refs[b] == 0:
                del refs[b]
                gone.append(b)
        self._release_slots(gone)
        return len(gone) * self.slot_bytes

    def _release_slots(self, block_ids: list[int]) -> None:
        slot_map, block_map = self._slot, self._block
        slots = list(map(slot_map.pop, block_ids))
        deque(map(block_map.__delitem__, slots), maxlen=0)
        self._free.extend(slots)
        if slots:
            self._free_sorted = False

    def _check_new(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            dup = [b for b in ids if b in seen or seen.add(b)]
            raise AlreadyResident(self.tier, dup)
        present = self.held(ids)
        if present:
            raise AlreadyResident(self.tier, present)

    # ------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Raises IntegrityError with the numbers if any invariant is broken."""
        t = self.tier
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise IntegrityError(f"{t}: free list has duplicates: {len(self._free)} entries, {len(free_set)} distinct")
        taken = set(self._block)
        if free_set & taken:
            raise IntegrityError(f"{t}: slots both free and taken: {sorted(free_set & taken)[:16]}")
        if len(free_set) + len(taken) != self.num_slots:
            raise IntegrityError(
                f"{t}: free {len(free_set)} + taken {len(taken)} != total {self.num_slots}")
        if any(s < 0 or s >= self.num_slots for s in free_set | taken):
            raise IntegrityError(f"{t}: slot out of range [0, {self.num_slots})")
        if len(self._slot) != len(self._block) or any(self._block.get(s) != b for b, s in self._slot.items()):
            raise IntegrityError(
                f"{t}: block->slot ({len(self._slot)}) and slot->block ({len(self._block)}) maps disagree")
        ready, reserved = set(self._refs), set(self._reserved)
        if ready & reserved:
            raise IntegrityError(f"{t}: blocks both ready and reserved: {sorted(ready & reserved)[:16]}")
        if ready | reserved != set(self._slot):
            raise IntegrityError(
                f"{t}: ready {len(ready)} + reserved {len(reserved)} != mapped {len(self._slot)}")
        low = {b: r for b, r in self._refs.items() if r < 1}
        if low:
            raise IntegrityError(f"{t}: ready blocks with refcount < 1: {dict(list(low.items())[:16])}")
        if self.used_bytes + self.free_bytes != self.capacity_bytes:
            raise IntegrityError(
                f"{t}: used {self.used_bytes} + free {self.free_bytes} != capacity {self.capacity_bytes}")
