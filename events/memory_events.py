"""The KV memory's events: budgets and pinned bytes, blocks committed and freed, every move of
their copies between tiers (requested, answered, stranded, settled late) and the sessions those
moves park, restore and delete.

NOTE: a new field goes at the end of its class, with a default (``events.event`` says why); a new
class joins the union in ``events.catalog``.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from residency.events.checksums import unpack_checksums
from residency.events.event import Event, Tier

MoveKind = Literal["spill", "evict", "park", "restore", "promote", "demote"]
MOVE_KINDS: tuple[str, ...] = ("spill", "evict", "park", "restore", "promote", "demote")
StrandedWhy = Literal["deadline", "worker_lost", "silent_release"]


# ---------------------------------------------------------------- budgets
class BudgetSet(Event):
    worker: int
    tier: Tier
    floor_bytes: int
    ceiling_bytes: int


class PinnedRegistered(Event):
    worker: int
    owner: str
    bytes: int


class PinnedReleased(Event):
    worker: int
    owner: str
    bytes: int


# ---------------------------------------------------------------- blocks
class BlocksCommitted(Event):
    """Blocks came into being on a tier (written by prefill/decode), owned by a session."""

    worker: int
    session: str | None
    tier: Tier
    blocks: list[int]
    keys: list[str]                   # content keys ("" for a partial block)
    bytes: int
    session_tokens: int | None = None  # positions the session's pages hold once these are in (None: not known)


class BlocksFreed(Event):
    """Copies of blocks were freed on one tier outside any move (a request finished, a client left,
    a worker's copies were dropped). Schema v2 added ``tier`` (v1 meant device)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    worker: int
    tier: Tier
    blocks: list[int]
    bytes: int
    reason: str                       # "finished", "disconnected", "dropped", "lost", ...


# ---------------------------------------------------------------- moves
class MoveRequested(Event):
    """A move was asked for and funded; nothing has moved yet. A release (free copies on one tier,
    copy nothing) is requested as ``src == dst`` with ``keep_source``: write-ahead like any move,
    so a release its worker never answers is stranded (``MoveStranded(why="silent_release")``).
    Its answer is ``CopiesReleased``."""

    move_id: str
    kind: MoveKind
    worker: int
    src: Tier
    dst: Tier
    blocks: list[int]
    bytes_planned: int
    keep_source: bool
    deadline_ns: int
    reason: str
    session: str | None = None


class CopiesReleased(Event):
    """A worker freed the copies a release asked for (a ``MoveRequested`` with ``src == dst``):
    ``bytes`` as the worker measured them (0 measured is recorded as 0; silence is a stranding,
    never 0). It settles the release: its terminal outcome, or after a ``MoveStranded`` its late
    answer (as a ``MoveLateAcked`` is for a move).

    Ledgers written before this event recorded the same answer as two rows, ``MoveAcked`` (or
    ``MoveLateAcked``) with nothing moved or freed, then ``BlocksFreed(reason="release")``; the fold
    and every reader give both forms the same meaning (no upcaster can merge two rows into one:
    the rows' seqs are what checkpoints, causation and the hash chain name)."""

    move_id: str                      # the release's id (``ReleaseBlocks.release_id``)
    worker: int
    tier: Tier
    blocks: list[int]
    bytes: int
    session: str | None = None        # the session whose pages were freed (its MoveRequested's), if any


class MoveDispatched(Event):
    move_id: str
    worker: int


class MoveAcked(Event):
    """The worker's copy landed (and, into the device, matched). ``checksums``: each block's
    psum64 in the command's block order, packed as little-endian uint64 (8 bytes per block;
    ``checksum_list()`` unpacks). Schema v2 packed them; v1 stored a list of ints (a Python int
    per block to build on every decode, on the control loop, for every big move's ack)."""

    SCHEMA_VERSION: ClassVar[int] = 2
    move_id: str
    worker: int
    bytes_moved: int
    bytes_freed_src: int
    checksum_ok: bool
    started_ns: int
    finished_ns: int
    checksums: bytes = b""

    def checksum_list(self) -> list[int]:
        return unpack_checksums(self.checksums)


class MoveFailed(Event):
    move_id: str
    worker: int
    error: str
    bytes_moved: int | None = None    # None = not measured; 0 = measured nothing


class MoveRejected(Event):
    """The worker refused the command (bad blocks, no room); nothing moved."""

    move_id: str
    worker: int
    reason: str
    asked_bytes: int
    available_bytes: int | None = None
    blocks: list[int] = []


class MoveRefused(Event):
    """The control plane declined an ask it could not fund; no MoveRequested exists for it."""

    ask: str                          # who asked for what, e.g. "policy:spill" or "operator:park"
    worker: int
    tier: Tier
    asked_bytes: int
    available_bytes: int
    floor_bytes: int
    reason: str
    session: str | None = None


class MoveStranded(Event):
    move_id: str
    worker: int
    bytes_at_risk: int
    why: StrandedWhy


class MoveLateAcked(Event):
    move_id: str
    worker: int
    bytes_moved: int
    bytes_freed_src: int
    checksum_ok: bool
    started_ns: int
    finished_ns: int


class MoveAbandoned(Event):
    move_id: str
    worker: int
    why: str


class MoveLateFailed(Event):
    """A stranded move's late answer saying nothing landed: the worker rejected it (its deadline
    had passed before it ran), reported it failed, or never received it and has tombstoned its id.
    It settles the stranding as ``MoveLateAcked`` does, but moves no copy: the source copies stand
    and the bytes that were at risk are no longer. ``answer`` is the worker's outcome type
    ("MoveRejected", "MoveFailed") or "unknown"; ``reason`` its words."""

    move_id: str
    worker: int
    answer: str
    reason: str


# ---------------------------------------------------------------- sessions
class SessionParked(Event):
    session: str
    worker: int
    tier: Tier
    bytes: int
    move_id: str


class SessionRestored(Event):
    session: str
    worker: int
    restored_tokens: int
    computed_tokens: int
    move_id: str | None = None


class SessionDeleted(Event):
    """Every copy of a session's pages was freed by its releases (recorded before this) and the
    session is forgotten: its next turn starts from nothing. ``bytes_freed`` sums the releases'
    ``CopiesReleased``; ``reason`` says who asked (an operator, the retention budget)."""

    session: str
    worker: int | None
    bytes_freed: int
    reason: str


__all__ = [
    "BudgetSet", "PinnedRegistered", "PinnedReleased", "BlocksCommitted", "BlocksFreed",
    "MoveRequested", "CopiesReleased", "MoveDispatched", "MoveAcked", "MoveFailed", "MoveRejected",
    "MoveRefused", "MoveStranded", "MoveLateAcked", "MoveAbandoned", "MoveLateFailed",
    "SessionParked", "SessionRestored", "SessionDeleted", "MoveKind", "MOVE_KINDS", "StrandedWhy",
]
