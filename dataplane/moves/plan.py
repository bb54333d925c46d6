"""Validate an ``ExecuteMove`` against the pools: a ``MovePlan``, or a ``MoveRejected`` saying why.

Pure with respect to the pools: it reads them and changes nothing, so a rejected command leaves
the worker exactly as it was. Checks, in order (the first that fails is the reason):

  1. route     the kind moves src→dst (table below) and evict/park free their source;
  2. blocks    non-empty, non-negative ints, no duplicates;
  3. deadline  not already past (a move begun after its deadline would only ever be late);
  4. busy      no block is part of a move in flight;
  5. source    every block is READY on src (listed if not);
  6. dest      no block is already on dst;
  7. holders   a move that frees a device block needs it to have no other holder (refcount 1);
  8. room      dst has n × block_bytes free: ``asked_bytes``/``available_bytes`` carry the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

from residency.events.catalog import MoveRejected
from residency.events.commands import ExecuteMove

ROUTES: dict[str, frozenset[tuple[str, str]]] = {
    "spill": frozenset({("device", "host"), ("device", "disk")}),
    "evict": frozenset({("device", "host"), ("device", "disk")}),
    "park": frozenset({("device", "host"), ("device", "disk")}),
    "restore": frozenset({("host", "device"), ("disk", "device")}),
    "demote": frozenset({("host", "disk")}),
    "promote": frozenset({("disk", "host")}),
}
FREES_SOURCE = frozenset({"evict", "park"})


@dataclass(frozen=True)
class MovePlan:
    cmd: ExecuteMove
    blocks: list[int]
    block_bytes: int

    @property
    def move_id(self) -> str:
        return self.cmd.move_id

    @property
    def route(self) -> tuple[str, str]:
        return (self.cmd.src, self.cmd.dst)

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.block_bytes


def validate(cmd: ExecuteMove, tiers: dict, busy: dict[int, str], block_bytes: int, worker: int,
             now_ns: int) -> MovePlan | MoveRejected:
    """``tiers`` maps tier name -> pool (DevicePool, HostPool, DiskTier)."""
    blocks = list(cmd.blocks)
    asked = len(blocks) * block_bytes

    def reject(reason: str, bad: list[int] | None = None, available: int | None = None) -> MoveRejected:
        return MoveRejected(move_id=cmd.move_id, worker=worker, reason=reason, asked_bytes=asked,
                            available_bytes=available, blocks=list(bad or []))

    routes = ROUTES.get(cmd.kind, frozenset())
    if (cmd.src, cmd.dst) not in routes:
        legal = ", ".join(f"{s}->{d}" for s, d in sorted(routes)) or "nothing"
        return reject(f"route: {cmd.kind} does not move {cmd.src}->{cmd.dst} (it moves {legal})")
    if cmd.kind in FREES_SOURCE and cmd.keep_source:
        return reject(f"route: {cmd.kind} frees its source; keep_source=True contradicts it")
    if not blocks:
        return reject("blocks: the command names no blocks")
    # NOTE: every check runs on each block of every move (1024 for a 2 GiB spill): each is one
    # C-level pass (map, set, min) and walks the list in Python only to name the offenders.
    if set(map(type, blocks)) != {int} or min(blocks) < 0:
        bad = [b for b in blocks if type(b) is not int or b < 0]
        return reject(f"blocks: ids must be ints >= 0, got {bad[:16]}", [b for b in bad if isinstance(b, int)])
    unique = set(blocks)
    if len(unique) != len(blocks):
        seen: set[int] = set()
        dup = sorted({b for b in blocks if b in seen or seen.add(b)})
        return reject(f"blocks: listed more than once: {dup[:16]}", dup)
    if cmd.deadline_ns > 0 and now_ns > cmd.deadline_ns:
        late_ms = (now_ns - cmd.deadline_ns) / 1e6
        return reject(f"deadline: passed {late_ms:.3f} ms before the move could start")
    in_flight = [] if busy.keys().isdisjoint(unique) else [b for b in blocks if b in busy]
    if in_flight:
        names = sorted({busy[b] for b in in_flight})[:4]
        return reject(f"busy: {len(in_flight)} blocks are in moves in flight ({names})", in_flight)
    src, dst = tiers[cmd.src], tiers[cmd.dst]
    absent = src.not_ready(unique) and src.not_ready(blocks)
    if absent:
        return reject(f"source: {len(absent)} of {len(blocks)} blocks are not resident on {cmd.src}", absent)
    present = dst.held(blocks)
    if present:
        return reject(f"dest: {len(present)} blocks are already on {cmd.dst}", present)
    if cmd.src == "device" and not cmd.keep_source:
        held = src.table.shared(blocks)
        if held:
            return reject(f"holders: {len(held)} device blocks have other holders; freeing them would pull "
                          f"pages from under a reader", held)
    refused = dst.room_for(len(blocks))
    if refused is not None:
        return reject(f"room: {refused}", [], refused.available_bytes)
    return MovePlan(cmd=cmd, blocks=blocks, block_bytes=block_bytes)
