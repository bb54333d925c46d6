"""What operators and the API ask the control process, and what it answers (its ask socket).

``residency status|ctl`` send these over the control's ask socket; the in-process API hands them
to ``ControlProc.submit``. An ask is answered once, with what the ledger recorded for it.

    AnyAsk        what the ask socket accepts
    AnyAskReply   what it answers (an ``ErrorReply`` names input it could not decode)
"""
from __future__ import annotations

from typing import Union

from residency.events.catalog import (
    BlocksCommitted, BlocksFreed, BudgetSet, CopiesReleased, FlipCompleted, FlipFailed, FlipRequested, MoveAbandoned, MoveAcked, MoveFailed, MoveKind, MoveLateAcked,
    MoveRefused, MoveRejected, MoveStranded, PoolResized, ReaderStamped, RebindCommitted, RebindRefused,
    RebindRequested, RebindTorn, SessionParked, SessionRestored, TenantReclaimed, TenantReclaimFailed, TenantReleased,
    Tier,
)
from residency.events.commands import ErrorReply
from residency.events.message import Message


class AskMove(Message):
    """Ask for a move. The control checks it against the budget authority of the destination;
    an ask it cannot fund is answered with the ``MoveRefused`` it recorded, never retried smaller.

    ``blocks`` empty means "every block of ``session`` on ``src``"; ``src``/``dst`` None means
    the kind's usual tiers (a restore takes each block from wherever its copy is)."""

    ask_id: str
    kind: MoveKind
    worker: int
    blocks: list[int] = []
    session: str | None = None
    src: Tier | None = None
    dst: Tier | None = None
    keep_source: bool | None = None   # None: spill/promote keep the source, the others free it
    wait: bool = True                 # False: answer once MoveRequested is committed


class AskCommitBlocks(Message):
    """Fill ``num_blocks`` new blocks on a tier with seeded bytes (tests, demos; the model
    runner writes its own blocks)."""

    ask_id: str
    worker: int
    session: str | None
    tier: Tier
    num_blocks: int
    seed: int = 0


class AskReleaseBlocks(Message):
    ask_id: str
    worker: int
    tier: Tier
    blocks: list[int]
    reason: str = "operator"
    session: str | None = None        # whose pages these are, recorded on the release


class AskSetBudget(Message):
    ask_id: str
    worker: int
    tier: Tier
    floor_bytes: int
    ceiling_bytes: int


class AskReclaim(Message):
    """An outside tenant (declared with ``serve --tenant``) asks for ``bytes`` of worker
    ``worker``'s device memory: the control empties pool slots by the tenant's routes, then shrinks
    the device pool by the ask rounded up to whole pages. Answered with ``TenantReclaimed``, the
    ``MoveRefused`` of an ask above everything reclaimable (nothing moved), or
    ``TenantReclaimFailed``; an unknown tenant or a size <= 0 is an invalid ask."""

    ask_id: str
    tenant: str
    worker: int
    bytes: int


class AskReleaseTenant(Message):
    """An outside tenant gives back everything it was granted on ``worker``: the device pool
    grows back by it. Answered with ``TenantReleased``."""

    ask_id: str
    tenant: str
    worker: int


class AskResize(Message):
    """Resize a worker's pool on ``tier`` to ``bytes`` (the dial: control/dial.py), live. A
    shrink first moves the coldest idle blocks that will not fit to host; then every reader of
    the pool is rebound to a new generation, all or none. Answered with what was recorded: the
    moves' outcomes, ``RebindRequested``, a ``ReaderStamped`` per reader, ``PoolResized`` (with
    the bytes the worker measured) and ``RebindCommitted`` or ``RebindTorn``; or the refusal
    (``MoveRefused`` with its arithmetic, ``RebindRefused`` with the worker's), never retried
    smaller. ``bytes`` is rounded down to whole blocks."""

    ask_id: str
    worker: int
    tier: Tier
    bytes: int


class AskFlip(Message):
    """Flip, sleep or wake a worker's weights arena (control/flip.py, issue #28). ``action``:
    "flip" (the arena's image becomes ``to_model``, one of the models the worker was started with),
    "sleep" (``level`` 1: the image to pinned host; 2: dropped, reloaded from its file on wake) or
    "wake". ``worker`` None: a flip goes to the lowest worker not serving ``to_model``; a sleep or
    wake to every serving worker. First the worker's requests end and its sessions' device pages
    are parked; then ``FlipRequested`` and the rebind of the arena's readers are recorded ahead of
    the command. Answered with what was recorded: the parks, ``FlipRequested``,
    ``RebindRequested``, the stamps, ``FlipCompleted`` and ``RebindCommitted``; or ``FlipFailed``
    (the worker's error verbatim, or stranded); or the ``MoveRefused`` of a flip that was declined
    (one already running, sleep while asleep, wake while awake). An unknown model or worker is an
    invalid ask (its detail lists the models)."""

    ask_id: str
    action: str
    to_model: str = ""
    worker: int | None = None
    level: int = 1


class AskStatus(Message):
    ask_id: str = ""
    include_state: bool = True


AskOutcome = Union[
    MoveAcked, MoveFailed, MoveRejected, MoveRefused, MoveStranded, MoveLateAcked, MoveAbandoned,
    BlocksCommitted, BlocksFreed, BudgetSet, SessionParked, SessionRestored, CopiesReleased,
    RebindRequested, ReaderStamped, PoolResized, RebindCommitted, RebindTorn, RebindRefused,
    TenantReclaimed, TenantReclaimFailed, TenantReleased,
    FlipRequested, FlipCompleted, FlipFailed,
]


class AskAnswered(Message):
    """What the ledger recorded for an ask, in seq order (``seqs[i]`` is ``events[i]``'s seq).
    ``error`` names why nothing was recorded (an invalid ask), with ``detail``."""

    ask_id: str
    events: list[AskOutcome] = []
    seqs: list[int] = []
    move_ids: list[str] = []
    error: str | None = None
    detail: str = ""


class StatusReport(Message):
    """The live state: ``state`` is ``control.state.encode_state`` bytes (msgpack, no pickle)."""

    ask_id: str
    last_seq: int
    state_hash: str
    healthy: bool
    problems: list[str]
    metrics: dict[str, float]
    state: bytes = b""


class AskMemory(Message):
    """The memory view (control/memory.py): the books of every worker and tier, with a fresh
    probe of each worker's counters. A worker that does not answer within ``probe_timeout_ms``
    is shown with its probe unknown."""

    ask_id: str = ""
    probe_timeout_ms: int = 1000


class MemoryAnswer(Message):
    """``view``: the view as JSON (control/memory.py ``MemoryView``; JSON so the API hands it on
    as it is and ``ctl memory`` prints it)."""

    ask_id: str
    view: bytes


AnyAsk = Union[AskMove, AskCommitBlocks, AskReleaseBlocks, AskSetBudget, AskStatus, AskMemory, AskResize, AskReclaim,
               AskReleaseTenant, AskFlip]
AnyAskReply = Union[AskAnswered, StatusReport, ErrorReply, MemoryAnswer]

__all__ = [
    "AskMove", "AskCommitBlocks", "AskReleaseBlocks", "AskSetBudget", "AskStatus", "AskResize", "AskOutcome",
    "AskAnswered", "StatusReport", "AnyAsk", "AnyAskReply", "AskMemory", "MemoryAnswer", "AskReclaim", "AskReleaseTenant",
    "AskFlip",
]
