"""Messages between the control process and data-plane workers (never stored as events).

Commands are imperative (``ExecuteMove``); replies are past tense or nouns. A worker answers a
move with one of the catalog's outcome events (``MoveAcked``, ``MoveFailed``, ``MoveRejected``),
so what the worker measured is exactly what the ledger records.
"""
from __future__ import annotations

from typing import Union

from residency.events.catalog import MoveAcked, MoveFailed, MoveKind, MoveRejected, Tier
from residency.events.message import Message


# ---------------------------------------------------------------- control -> worker
class ExecuteMove(Message):
    move_id: str
    kind: MoveKind
    src: Tier
    dst: Tier
    blocks: list[int]
    keep_source: bool
    deadline_ns: int
    session: str | None = None


class CommitBlocks(Message):
    """Fill new blocks on a tier (the model's prefill does this; tests use seeded random bytes)."""

    request_id: str
    session: str | None
    tier: Tier
    blocks: list[int]
    seed: int


class ReleaseBlocks(Message):
    release_id: str
    tier: Tier
    blocks: list[int]


class QueryMoves(Message):
    """After a control restart: which of these moves did you complete, and how?"""

    move_ids: list[str]


class Ping(Message):
    nonce: int
    ts_ns: int


class Shutdown(Message):
    reason: str


# ---------------------------------------------------------------- worker -> control
class Hello(Message):
    worker: int
    epoch: int
    device: str
    tiers: dict[str, int]
    block_bytes: int
    # The identity of the worker's engine lane (a second DEALER owned by its engine thread), or
    # None. With a lane, the engine's commands go to the lane once a LaneHello came from it, and
    # their replies come back on it; Ping, QueryMoves and Shutdown stay on this socket.
    lane: str | None = None
    # Blocks whose files this incarnation found on its disk at start, each verified (a worker run
    # with --keep-disk), until the control's ClaimDisk says which of them the ledger still has.
    disk_blocks: list[int] = []


class Pong(Message):
    worker: int
    nonce: int
    ts_ns: int


class BlocksWritten(Message):
    request_id: str
    worker: int
    tier: Tier
    blocks: list[int]
    bytes: int
    keys: list[str]


class BlocksReleased(Message):
    release_id: str
    worker: int
    tier: Tier
    blocks: list[int]
    bytes_freed: int                  # measured by the pool; 0 is an accounting, silence is not


class MovesReport(Message):
    worker: int
    outcomes: list[Union[MoveAcked, MoveFailed, MoveRejected]]
    unknown: list[str]                # move_ids the worker never saw


class ErrorReply(Message):
    """A named error for a message that could not be decoded or handled."""

    error: str
    detail: str


AnyCommand = Union[ExecuteMove, CommitBlocks, ReleaseBlocks, QueryMoves, Ping, Shutdown]
AnyReply = Union[
    Hello, Pong, BlocksWritten, BlocksReleased, MovesReport, ErrorReply,
    MoveAcked, MoveFailed, MoveRejected,
]
AnyMessage = Union[
    ExecuteMove, CommitBlocks, ReleaseBlocks, QueryMoves, Ping, Shutdown,
    Hello, Pong, BlocksWritten, BlocksReleased, MovesReport, ErrorReply,
    MoveAcked, MoveFailed, MoveRejected,
]

__all__ = [
    "Message", "ExecuteMove", "CommitBlocks", "ReleaseBlocks", "QueryMoves", "Ping", "Shutdown",
    "Hello", "Pong", "BlocksWritten", "BlocksReleased", "MovesReport", "ErrorReply",
    "AnyCommand", "AnyReply", "AnyMessage",
]


# ---------------------------------------------------------------- serving (control <-> worker)
# The messages of the inference path live in events/serving.py; they join the unions here.
from residency.events.serving import (  # noqa: E402
    MAX_LOGPROBS, CancelGenerate, ChatTurn, Generate, SamplingParams, ServingReady, TokenChoice, TokenLogprobs,
    Tokenize, Tokenized, TokensGenerated,
)

# The serving messages join the unions (appended so existing members keep their order).
from residency.events.catalog import StepCompleted  # noqa: E402

AnyCommand = Union[AnyCommand, Tokenize, Generate, CancelGenerate]  # type: ignore[misc]
AnyReply = Union[AnyReply, Tokenized, ServingReady, TokensGenerated, StepCompleted]  # type: ignore[misc]
AnyMessage = Union[  # type: ignore[misc]
    AnyMessage, Tokenize, Generate, CancelGenerate, Tokenized, ServingReady, TokensGenerated, StepCompleted,
]
__all__ += [
    "ChatTurn", "MAX_LOGPROBS", "SamplingParams", "TokenChoice", "TokenLogprobs", "Tokenize", "Tokenized",
    "ServingReady", "Generate", "CancelGenerate", "TokensGenerated",
]


class CommandFailed(Message):
    """A worker could not carry out a command that is not a move (a commit with no room, a release
    of blocks it does not hold); ``ref`` is the command's ``request_id`` or ``release_id``."""

    worker: int
    ref: str
    error: str
    detail: str


AnyReply = Union[AnyReply, CommandFailed]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, CommandFailed]  # type: ignore[misc]
__all__ += ["CommandFailed"]


class QueryInventory(Message):
    """Which blocks do you hold on each tier? (Checks the ledger's accounts against the memory.)"""

    nonce: int = 0


class Inventory(Message):
    worker: int
    nonce: int
    blocks: dict[str, list[int]]      # tier -> block ids held (ready)
    used_bytes: dict[str, int]        # tier -> bytes taken, including slots reserved by moves in flight


class ClaimDisk(Message):
    """To a new incarnation that found block files on its disk (``Hello.disk_blocks``): keep these
    (the ledger has them there: ``WorkerLost.kept_on_disk``), delete every other one."""

    keep: list[int]


class DiskClaimed(Message):
    worker: int
    kept: list[int]
    dropped: list[int]                # files deleted: blocks the ledger does not have on this disk
    bytes_dropped: int


AnyCommand = Union[AnyCommand, QueryInventory, ClaimDisk]  # type: ignore[misc]
AnyReply = Union[AnyReply, Inventory, DiskClaimed]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, QueryInventory, Inventory, ClaimDisk, DiskClaimed]  # type: ignore[misc]
__all__ += ["QueryInventory", "Inventory", "ClaimDisk", "DiskClaimed"]


class MoveTimed(Message):
    """Where a move's time went inside the worker, sent right after the move's outcome by a worker
    started with ``--report-timings`` (benchmarks). Wall-clock ns (``time.time_ns``, the clock of
    ``MoveAcked.started_ns``/``finished_ns``). A measurement, never recorded in the ledger.

        received_ns         the command read off the socket (before decoding)
        queued_ns           decoded and checked, handed to the engine thread
        engine_start_ns     the engine thread took it
        engine_end_ns       the engine returned the outcome
        sent_ns             the outcome encoded and handed to ZMQ
        ahead_ns            (an early start) when the CommandAhead carrying the command was read:
                            received_ns is then the command's arrival, after engine_start_ns
    """

    move_id: str
    worker: int
    received_ns: int
    queued_ns: int
    engine_start_ns: int
    engine_end_ns: int
    sent_ns: int
    ahead_ns: int = 0


AnyReply = Union[AnyReply, MoveTimed]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, MoveTimed]  # type: ignore[misc]
__all__ += ["MoveTimed"]


class LaneHello(Message):
    """The first message on a worker's engine lane (and again after each Hello): the lane's
    connection is up, so the control may now send the engine's commands there."""

    worker: int
    epoch: int


AnyReply = Union[AnyReply, LaneHello]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, LaneHello]  # type: ignore[misc]
__all__ += ["LaneHello"]


class MoveNearlyDone(Message):
    """Sent on a worker's engine lane when a move of several pipelined chunks has all but its last
    chunk across: its ack follows in about the time ``bytes_left`` takes on the link. The control
    stays awake for that ack (``ControlConfig.ack_spin_max_us``) instead of sleeping in its poll
    through the wake-up of a long-idle thread (bench/zmq_wake.py). A hint, never recorded in the
    ledger; a lost or ignored one changes nothing but the ack's latency."""

    move_id: str
    worker: int
    bytes_left: int
    # the worker's estimate of how long until its outcome leaves: ``bytes_left`` at the rate the
    # move has run so far (0: no estimate). The control warms its ledger writer shortly before.
    eta_us: int = 0


AnyReply = Union[AnyReply, MoveNearlyDone]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, MoveNearlyDone]  # type: ignore[misc]
__all__ += ["MoveNearlyDone"]


class CommandAhead(Message):
    """Sent to a worker's engine lane when a big move has been decided, before its MoveRequested
    commits: its ExecuteMove follows once the commit is done (write-ahead: never before). The lane
    polls without sleeping until the command comes, at most ``within_us``, so the command is read
    the moment it lands instead of after a long-idle thread wakes (bench/zmq_wake.py). A hint: it
    asks for nothing, is never answered, and a lost or ignored one changes only latency.

    ``command``: (device <-> host copies) the ExecuteMove that will follow, so the worker may
    start its copies early, into destination slots it reserves and nobody can see
    (``WorkerCore.start_ahead``). Nothing visible happens before the command itself arrives: no
    block is published or freed, no outcome exists, a ``QueryMoves`` answers "unknown". If the
    command does not come (the commit failed, the control died, the move was settled first) or
    another command comes first, the copies are abandoned and the reservation undone exactly.

    ``move_id`` "": an ask for a big copy has just come; its move is not decided yet (the control
    wakes the lane before resolving the ask, and the hint with the command follows)."""

    move_id: str
    within_us: int
    command: ExecuteMove | None = None


AnyCommand = Union[AnyCommand, CommandAhead]  # type: ignore[misc]
AnyMessage = Union[AnyMessage, CommandAhead]  # type: ignore[misc]
__all__ += ["CommandAhead"]
