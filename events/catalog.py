"""Every event Residency records, one Struct per fact, past-tense names: the union and its registry.

All events form one tagged union (the tag is the class name); the classes live by role in
``events.memory_events`` (KV budgets, blocks, moves, sessions), ``events.serving_events`` (server,
workers, requests, steps, groups, experts) and ``events.rebind_events`` (pool rebinds, weights
flips, outside tenants), on the base in ``events.event``. Every one of them is importable from here.
Structs are ``array_like`` so a stored payload is a compact msgpack array:
``["MoveAcked", "m-17", 0, 2097152, ...]``.
NOTE: because payloads are positional, a new field is only ever appended at the end with a
default; any other change bumps ``SCHEMA_VERSION`` and adds an upcaster in ``events.upcast``.
A new event class joins ``AnyEvent`` below (its tag is then known to every decoder).
"""
from __future__ import annotations

from typing import Union

from residency.events.checksums import pack_checksums, unpack_checksums  # noqa: F401  (MoveAcked's packing)
from residency.events.event import TIERS, Event, Tier
from residency.events.memory_events import (  # noqa: F401  (re-exported: the catalog is the package's API)
    MOVE_KINDS,
    MoveKind,
    StrandedWhy,
    BudgetSet,
    PinnedRegistered,
    PinnedReleased,
    BlocksCommitted,
    BlocksFreed,
    MoveRequested,
    CopiesReleased,
    MoveDispatched,
    MoveAcked,
    MoveFailed,
    MoveRejected,
    MoveRefused,
    MoveStranded,
    MoveLateAcked,
    MoveAbandoned,
    MoveLateFailed,
    SessionParked,
    SessionRestored,
    SessionDeleted,
)
from residency.events.rebind_events import (  # noqa: F401  (re-exported: the catalog is the package's API)
    RebindRequested,
    ReaderStamped,
    RebindCommitted,
    RebindTorn,
    PoolResized,
    RebindRefused,
    WeightsLoaded,
    FlipRequested,
    FlipCompleted,
    FlipFailed,
    TenantReclaimed,
    TenantReclaimFailed,
    TenantReleased,
)
from residency.events.serving_events import (  # noqa: F401  (re-exported: the catalog is the package's API)
    EXPERT_MOVE_KINDS,
    DivergenceCaught,
    ExpertMove,
    ExpertMoveKind,
    ServerStarted,
    ServerStopped,
    WorkerJoined,
    WorkerHeartbeatMissed,
    WorkerLost,
    WorkerWedged,
    WorkerResumed,
    RequestAdmitted,
    RequestRefused,
    RequestFinished,
    RequestQueued,
    StepCompleted,
    GroupDiverged,
    GroupStopped,
    ExpertsMoved,
)


# ---------------------------------------------------------------- integrity
class StateCheckpoint(Event):
    through_seq: int
    state_hash: str


AnyEvent = Union[
    ServerStarted, ServerStopped,
    WorkerJoined, WorkerHeartbeatMissed, WorkerLost, WorkerWedged, WorkerResumed,
    BudgetSet, PinnedRegistered, PinnedReleased,
    BlocksCommitted, BlocksFreed,
    MoveRequested, MoveDispatched, MoveAcked, MoveFailed, MoveRejected, MoveRefused,
    MoveStranded, MoveLateAcked, MoveAbandoned, CopiesReleased, MoveLateFailed,
    SessionParked, SessionRestored, SessionDeleted,
    RequestAdmitted, RequestRefused, RequestFinished, RequestQueued,
    StepCompleted,
    RebindRequested, ReaderStamped, RebindCommitted, RebindTorn, PoolResized, RebindRefused,
    WeightsLoaded, FlipRequested, FlipCompleted, FlipFailed,
    GroupDiverged, GroupStopped,
    TenantReclaimed, TenantReclaimFailed, TenantReleased,
    StateCheckpoint,
    ExpertsMoved,
]

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}

# Terminal outcomes of a MoveRequested (MoveStranded is terminal but may be followed by
# exactly one late answer: MoveLateAcked, which re-accounts the stranded bytes, or MoveLateFailed,
# which releases them). A release's CopiesReleased is its terminal outcome, or its late answer
# after a MoveStranded.
TERMINAL_MOVE_EVENTS = ("MoveAcked", "MoveFailed", "MoveRejected", "MoveStranded", "MoveAbandoned")


def event_type_name(event: Event) -> str:
    return type(event).__name__


__all__ = [name for name in EVENT_TYPES] + [
    "Event", "AnyEvent", "EVENT_TYPES", "TERMINAL_MOVE_EVENTS", "Tier", "TIERS",
    "MoveKind", "MOVE_KINDS", "StrandedWhy", "DivergenceCaught", "event_type_name", "ExpertMove", "ExpertMoveKind",
    "EXPERT_MOVE_KINDS",
]
