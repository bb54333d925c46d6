"""Messages between the control process and data-plane workers (never stored as events).

Commands are imperative (``ExecuteMove``); replies are past tense or nouns. A worker answers a
move with one of the catalog's outcome events (``MoveAcked``, ``MoveFailed``, ``MoveRejected``),
so what the worker measured is exactly what the ledger records.

Each side decodes with one closed union, declared once at the end of the worker protocol:
``ToWorker`` (what a worker's sockets accept: the control's commands and a named error) and
``FromWorker`` (what a worker sends). The serving messages (events/serving.py) are members.
"""
from __future__ import annotations

from typing import Union

from residency.events.catalog import ExpertsMoved, MoveAcked, MoveFailed, MoveKind, MoveRejected, StepCompleted, Tier
from residency.events.message import Message
from residency.events.serving import (
    MAX_LOGPROBS, CancelGenerate, ChatTurn, Generate, SamplingParams, ServedModel, ServingReady, StepBallot,
    StepRefused, TokenChoice, TokenLogprobs,
    Tokenize, Tokenized, TokensGenerated,
)


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


class QueryInventory(Message):
    """Which blocks do you hold on each tier? (Checks the ledger's accounts against the memory.)"""

    nonce: int = 0


class ClaimDisk(Message):
    """To a new incarnation that found block files on its disk (``Hello.disk_blocks``): keep these
    (the ledger has them there: ``WorkerLost.kept_on_disk``), delete every other one."""

    keep: list[int]


class CommandAhead(Message):
    """Sent to a worker's lane (its device thread's socket) when a big move has been decided, before its MoveRequested
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


class ResizePool(Message):
    """Resize a worker's pool on ``tier`` (the device KV pool) to ``num_slots`` and rebind every
    reader of it in the worker to generation ``to_gen`` (the dial: control/dial.py).

    Write-ahead: the control records ``RebindRequested`` before it sends this. Before a shrink the
    control has already moved out (spilled, evicted) every block that will not fit below
    ``num_slots``; the worker relocates the live blocks that sit in slots at or above it into
    free slots below it (device to device), makes the new tensor, copies what it keeps, lets the
    old one go, and measures what the allocator and the driver say afterwards. It never drops a
    block: if the blocks it holds do not fit in ``num_slots`` it refuses (``PoolRebound.error``)
    and changes nothing. The worker answers with ``PoolRebound``."""

    rebind_id: str
    tier: Tier
    num_slots: int
    to_gen: int
    deadline_ns: int


class SwapWeights(Message):
    """Flip, sleep or wake the worker's weights arena (issue #28: a flip is a rebind of every
    reader of the arena: the model runner's parameter views, captured CUDA graphs).

    Write-ahead: the control records ``FlipRequested`` before it sends this, and before a flip or
    a sleep it has parked (moved to host) every session page of the outgoing model and stopped
    admitting its requests; the worker refuses if a sequence still runs (``WeightsSwapped.error``).

    ``action`` "flip": the arena's image becomes ``to_model`` (a model the worker was started with);
    the outgoing image goes to the host slab (the rotation, dataplane/flip/rotation.py) or, when the
    host holds both images, only the incoming bytes move. "sleep": ``level`` 1 copies the image to
    pinned host and frees the arena's device memory; level 2 drops it (wake reloads it from the
    model's file). "wake": the image that slept comes back (``to_model`` "" : the one that slept).
    The worker checks both images' checksums, binds every reader to ``to_gen`` or none, and answers
    ``WeightsSwapped``. Anything it refuses (unknown model, slab too small, a checksum that fails
    before the move) changes nothing."""

    flip_id: str
    action: str
    to_model: str = ""
    level: int = 1
    to_gen: int = 0
    deadline_ns: int = 0


# ---------------------------------------------------------------- worker -> control
class PoolSizing(Message):
    """How a worker's device KV pool got its size (dataplane/sizing.py): ``how`` "fraction"
    (measured after the weights loaded: pool = fraction x total - in_use - reserve, in whole
    blocks), "explicit" (``--device-blocks``; nothing measured: the measured fields are None) or
    "refused" (it did not reach ``min_blocks``)."""

    how: str
    device: str
    num_blocks: int
    block_bytes: int
    pool_bytes: int
    weights_bytes: int = 0
    fraction: float | None = None
    total_bytes: int | None = None
    budget_bytes: int | None = None
    in_use_bytes: int | None = None
    reserve_bytes: int | None = None
    min_blocks: int = 0


class Hello(Message):
    worker: int
    epoch: int
    device: str
    tiers: dict[str, int]
    block_bytes: int
    # The identity of the worker's lane (a second DEALER owned by its device thread), or None.
    # With a lane, the device's commands go to the lane once a LaneHello came from it, and their
    # replies come back on it; Ping, QueryMoves, Shutdown and Tokenize stay on this socket.
    lane: str | None = None
    # Blocks whose files this incarnation found on its disk at start, each verified (a worker run
    # with --keep-disk), until the control's ClaimDisk says which of them the ledger still has.
    disk_blocks: list[int] = []
    # The dial: the generation its device pool carries (a new incarnation starts at 0 again), and
    # the readers of that pool it has so far (ServingReady adds the serving loop's).
    pool_gen: int = 0
    readers: list[str] = []
    # The memory authority: pinned host bytes by owner (each grant of the worker's PinnedBudget,
    # summed per owner), device bytes held outside the KV pool by owner ("weights", "scratch"),
    # the model whose weights those are ("" with none), the allocator's growth over the weights
    # load (CUDA; None: not measured), and how the pool was sized.
    pinned: dict[str, int] = {}
    device_owned: dict[str, int] = {}
    model: str = ""
    weights_allocator_bytes: int | None = None
    sizing: PoolSizing | None = None
    pinned_limit_bytes: int | None = None
    # The resident model's image bytes by tier ("device": in the weights arena) and the image's
    # checksum (hex; "" not taken yet), for WeightsLoaded (issue #28)
    weights_tier_bytes: dict[str, int] = {}
    weights_checksum: str = ""
    # A tensor-parallel group (docs/groups.md): its name ("" alone), this worker's rank in it and
    # how many ranks it has. Every rank holds its shard of every block of the group.
    group: str = ""
    rank: int = 0
    ranks: int = 1


class Pong(Message):
    """The I/O thread's answer to a Ping; a worker that serves adds its engine's progress, read
    as the Pong leaves (the I/O thread answers even while the device thread is stuck, which is
    how the control tells a worker that is up from one that is making progress)."""

    worker: int
    nonce: int
    ts_ns: int
    num_steps: int | None = None      # serving steps completed so far; None: the worker serves no model
    num_running: int = 0              # sequences its serving loop holds
    num_turns: int = 0                # turns of the device thread's loop (they stop while it is stuck)


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


class PoolRebound(Message):
    """A worker's answer to ``ResizePool``: what it did and measured, and which of its readers
    now carry the new generation (``stamps``: reader -> gen). A reader missing from ``stamps``, or
    at another gen, did not stamp: the control records ``RebindTorn`` naming it. ``refused``:
    readers that refused to bind (a pool of the wrong shape), with why.

    ``error`` non-empty: nothing changed (e.g. the live blocks do not fit); the pool and every
    reader stay at ``from_gen``. Bytes are the pool's bytes; ``measured_freed_bytes`` is what the
    driver counts free afterwards less before (a grow: negative), None when it cannot be measured
    (a CPU host); ``allocator_freed_bytes`` the same from the allocator's counters."""

    rebind_id: str
    worker: int
    tier: Tier
    from_gen: int
    to_gen: int
    from_slots: int
    to_slots: int
    from_bytes: int
    to_bytes: int
    stamps: dict[str, int] = {}
    refused: dict[str, str] = {}
    blocks_relocated: int = 0
    measured_freed_bytes: int | None = None
    allocator_freed_bytes: int | None = None
    started_ns: int = 0
    finished_ns: int = 0
    error: str = ""


class WeightsSwapped(Message):
    """A worker's answer to ``SwapWeights``: what moved and what it measured. ``error`` non-empty:
    nothing changed (the arena, its image and every reader stay at ``from_gen``). ``resident``: the
    model whose weights the arena now holds ("" asleep). ``stamps``/``refused`` as in
    ``PoolRebound`` (readers of the arena)."""

    flip_id: str
    worker: int
    action: str
    from_model: str
    resident: str
    from_gen: int
    to_gen: int
    bytes_out: int = 0                # device -> host
    bytes_in: int = 0                 # host (or file) -> device
    dropped_bytes: int = 0            # a level-2 sleep: device bytes let go without a copy
    steps: int = 0
    overlapped_steps: int = 0
    checksum_ok: bool = False
    out_ns: int = 0
    in_ns: int = 0
    measured_freed_bytes: int | None = None
    stamps: dict[str, int] = {}
    refused: dict[str, str] = {}
    started_ns: int = 0
    finished_ns: int = 0
    error: str = ""


class MovesReport(Message):
    worker: int
    outcomes: list[Union[MoveAcked, MoveFailed, MoveRejected]]
    unknown: list[str]                # move_ids the worker never saw


class ErrorReply(Message):
    """A named error for a message that could not be decoded or handled."""

    error: str
    detail: str


class CommandFailed(Message):
    """A worker could not carry out a command that is not a move (a commit with no room, a release
    of blocks it does not hold); ``ref`` is the command's ``request_id`` or ``release_id``."""

    worker: int
    ref: str
    error: str
    detail: str


class Inventory(Message):
    worker: int
    nonce: int
    blocks: dict[str, list[int]]      # tier -> block ids held (ready)
    used_bytes: dict[str, int]        # tier -> bytes taken, including slots reserved by moves in flight


class DiskClaimed(Message):
    worker: int
    kept: list[int]
    dropped: list[int]                # files deleted: blocks the ledger does not have on this disk
    bytes_dropped: int


class LaneHello(Message):
    """The first message on a worker's lane (and again after each Hello): the lane's connection
    is up, so the control may now send the device's commands there."""

    worker: int
    epoch: int


class MoveNearlyDone(Message):
    """Sent on a worker's lane when a move of several pipelined chunks has all but its last
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


class MoveTimed(Message):
    """Where a move's time went inside the worker, sent right after the move's outcome by the
    benches' worker (bench/worker.py --report-timings); the control records it in its move traces.
    Wall-clock ns (``time.time_ns``, the clock of ``MoveAcked.started_ns``/``finished_ns``). A
    measurement, never recorded in the ledger.

        received_ns         the command read off the socket (before decoding)
        queued_ns           decoded and checked, about to run on the device thread
        engine_start_ns     the mover began it
        engine_end_ns       the mover returned the outcome
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


class QueryMemory(Message):
    """What do the device's driver and allocator, and the host, say now? Answered by ``MemoryReport``
    from the worker's I/O thread (it reads counters only: a busy device thread does not delay it)."""

    nonce: int


class MemoryReport(Message):
    """A worker's probe of its memory: None wherever a counter cannot be read (no CUDA: the
    device's driver and allocator counters), never 0 in its place."""

    worker: int
    nonce: int
    device_total_bytes: int | None = None       # the driver's total (CUDA) or MemTotal (CPU host)
    device_free_bytes: int | None = None        # the driver's free (CUDA) or MemAvailable (CPU host)
    allocator_allocated_bytes: int | None = None
    allocator_reserved_bytes: int | None = None
    pinned_in_use_bytes: int | None = None      # the PinnedBudget's grants, as the worker counts them
    pinned_limit_bytes: int | None = None
    device_owned: dict[str, int] = {}           # device bytes held outside the KV pool now, by owner
                                                # ("weights": the arena; 0 while its weights sleep)


class PinnedChanged(Message):
    """A pinned grant made or given back after Hello (``registered`` False: released)."""

    worker: int
    owner: str
    bytes: int
    registered: bool


# ---------------------------------------------------------------- the unions each side decodes with
# What the control process may send a worker's sockets: its commands, and a named error (e.g.
# ``unknown_worker`` after a control restart, which the worker answers with Hello).
ToWorker = Union[
    ExecuteMove, CommitBlocks, ReleaseBlocks, QueryMoves, Ping, Shutdown, QueryInventory, ClaimDisk, CommandAhead,
    ResizePool, SwapWeights,
    Tokenize, Generate, CancelGenerate,
    ErrorReply,
    QueryMemory,
]
# What a worker sends, from either socket.
FromWorker = Union[
    Hello, LaneHello, Pong, MovesReport, ErrorReply,
    MoveAcked, MoveFailed, MoveRejected, MoveNearlyDone, BlocksWritten, BlocksReleased, CommandFailed,
    Inventory, DiskClaimed, PoolRebound, WeightsSwapped,
    Tokenized, ServingReady, TokensGenerated, StepCompleted, StepRefused,
    MoveTimed,
    MemoryReport, PinnedChanged,
    ExpertsMoved,
]
AnyMessage = Union[ToWorker, FromWorker]

__all__ = [
    "Message", "ExecuteMove", "CommitBlocks", "ReleaseBlocks", "QueryMoves", "Ping", "Shutdown", "QueryInventory",
    "ClaimDisk", "CommandAhead", "ResizePool", "PoolRebound", "SwapWeights", "WeightsSwapped",
    "Hello", "LaneHello", "Pong", "BlocksWritten", "BlocksReleased", "MovesReport", "ErrorReply", "CommandFailed",
    "Inventory", "DiskClaimed", "MoveNearlyDone", "MoveTimed",
    "ChatTurn", "MAX_LOGPROBS", "SamplingParams", "TokenChoice", "TokenLogprobs", "Tokenize", "Tokenized",
    "ServedModel", "ServingReady", "Generate", "CancelGenerate", "TokensGenerated", "StepBallot", "StepRefused",
    "ToWorker", "FromWorker", "AnyMessage",
    "PoolSizing", "QueryMemory", "MemoryReport", "PinnedChanged",
]

