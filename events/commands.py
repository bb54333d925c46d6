"""Messages between the control process and data-plane workers (never stored as events).

Commands are imperative (``ExecuteMove``); replies are past tense or nouns. A worker answers a
move with one of the catalog's outcome events (``MoveAcked``, ``MoveFailed``, ``MoveRejected``),
so what the worker measured is exactly what the ledger records.
"""
from __future__ import annotations

from typing import Union

import msgspec

from events.catalog import MoveAcked, MoveFailed, MoveKind, MoveRejected, Tier


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True, gc=False):
    pass


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
# Appended for the inference path. A request's life on the wire:
#   control: Tokenize ─► worker: Tokenized (ids + content keys of its full pages)
#   control: [ExecuteMove restore … MoveAcked]  Generate ─► worker: TokensGenerated … BlocksWritten …
#            TokensGenerated(finish_reason)      (CancelGenerate ends it early: finish "cancelled")
#   worker:  StepCompleted after every batched forward step (the ledger's compact step record)
class ChatTurn(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One message of a conversation, as the client sent it (rendered by the model's own template)."""

    role: str
    content: str


MAX_LOGPROBS = 20                     # the most alternatives a token's logprobs may list


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    max_tokens: int
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None           # None = not seeded (a fresh generator per request)
    stop: list[str] = []              # stop strings; the text returned ends before the match
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; k: each token's log-probability and the k likeliest


class TokenChoice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A token at one position with its log-probability under the model (the raw distribution:
    before temperature and top_p), its text alone and the exact bytes it stands for (a token may
    hold part of a UTF-8 character; its text then shows U+FFFD)."""

    token_id: int
    text: str
    token_bytes: bytes
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The sampled token at one position and the likeliest ``SamplingParams.logprobs`` there."""

    chosen: TokenChoice
    top: list[TokenChoice] = []


class Tokenize(Message):
    """Render (chat) and tokenize a prompt the model's way. Exactly one of the three is set."""

    request_id: str
    messages: list[ChatTurn] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None


class Tokenized(Message):
    request_id: str
    worker: int
    token_ids: list[int]
    keys: list[str]                   # content keys of token_ids' full pages, in order
    error: str | None = None          # e.g. "chat_template_missing: ..."; token_ids is then []


class ServingReady(Message):
    """The worker loaded a model and can serve it (sent once, after Hello)."""

    worker: int
    model: str                        # the id clients name in requests
    model_digest: str
    max_context: int                  # positions the model supports (prompt + completion)
    page_tokens: int
    block_bytes: int
    device_blocks: int                # logical blocks the device pool can hold
    eos_token_ids: list[int]
    max_seqs: int = 0                 # sequences it batches at once (0: not said; no limit kept)


class Generate(Message):
    """Run one sequence. ``block_ids`` are its pages in order, enough for prompt + max_tokens;
    the first ``num_cached_tokens // page_tokens`` already hold this prompt's KV (resident, verified).

    When it ends, the worker frees the pages it wrote if ``free_on_finish`` (a request outside a
    session) or if it did not finish normally (cancelled, failed); a session's turn keeps them.
    The reused pages are never freed by the worker: they belong to earlier turns."""

    request_id: str
    session: str | None
    token_ids: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    sampling: SamplingParams
    free_on_finish: bool = False


class CancelGenerate(Message):
    request_id: str
    reason: str                       # "disconnected", "shutdown", ...


class TokensGenerated(Message):
    """Progress of one sequence, once per step it took part in; the last one has ``finish_reason``.

    It carries the pages the step filled (``blocks_written``: full pages with their content key;
    at the end, the partial tail with key ""), so the control process commits them to the ledger,
    owned by the request's session, in the order they were written. The last report also names
    the pages the worker freed (``blocks_freed``/``bytes_freed``, measured by the pool: see
    ``Generate.free_on_finish``) and the reserved pages it never reached (``blocks_unused``: never
    given a slot, never in the ledger).
    """

    request_id: str
    worker: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0      # prompt positions actually prefilled (the rest were cached)
    blocks_unused: list[int] = []
    blocks_written: list[int] = []
    keys_written: list[str] = []
    blocks_freed: list[int] = []
    bytes_freed: int = 0
    # with SamplingParams.logprobs: one per token of ``token_ids`` whose text is the answer's (an
    # end-of-turn token that stopped the sequence has none)
    logprobs: list[TokenLogprobs] = []


# The serving messages join the unions (appended so existing members keep their order).
from events.catalog import StepCompleted  # noqa: E402

AnyCommand = Union[AnyCommand, Tokenize, Generate, CancelGenerate]  # type: ignore[misc]
AnyReply = Union[AnyReply, Tokenized, ServingReady, TokensGenerated, StepCompleted]  # type: ignore[misc]
AnyMessage = Union[  # type: ignore[misc]
    AnyMessage, Tokenize, Generate, CancelGenerate, Tokenized, ServingReady, TokensGenerated, StepCompleted,
]
__all__ += [
    "ChatTurn", "MAX_LOGPROBS", "SamplingParams", "TokenChoice", "TokenLogprobs", "Tokenize", "Tokenized", "ServingReady", "Generate",
    "CancelGenerate", "TokensGenerated",
]


# ---------------------------------------------------------------- operators / the API -> control
# Appended for the control process's own socket (``residency status|ctl``) and its in-process
# API. An ask is answered once, with what the ledger recorded for it.
from events.catalog import (  # noqa: E402
    BlocksCommitted,
    BlocksFreed,
    BudgetSet,
    MoveAbandoned,
    MoveLateAcked,
    MoveRefused,
    MoveStranded,
    SessionParked,
    SessionRestored,
)


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


class AskSetBudget(Message):
    ask_id: str
    worker: int
    tier: Tier
    floor_bytes: int
    ceiling_bytes: int


class AskStatus(Message):
    ask_id: str = ""
    include_state: bool = True


AskOutcome = Union[
    MoveAcked, MoveFailed, MoveRejected, MoveRefused, MoveStranded, MoveLateAcked, MoveAbandoned,
    BlocksCommitted, BlocksFreed, BudgetSet, SessionParked, SessionRestored,
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


AnyAsk = Union[AskMove, AskCommitBlocks, AskReleaseBlocks, AskSetBudget, AskStatus]
AnyAskReply = Union[AskAnswered, StatusReport, ErrorReply]
AnyMessage = Union[  # type: ignore[misc]
    AnyMessage, AskMove, AskCommitBlocks, AskReleaseBlocks, AskSetBudget, AskStatus, AskAnswered, StatusReport,
]
__all__ += [
    "AskMove", "AskCommitBlocks", "AskReleaseBlocks", "AskSetBudget", "AskStatus", "AskOutcome",
    "AskAnswered", "StatusReport", "AnyAsk", "AnyAskReply",
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
