"""Every event Residency records, one Struct per fact, past-tense names.

All events form one tagged union (the tag is the class name). Structs are ``array_like`` so a
stored payload is a compact msgpack array: ``["MoveAcked", "m-17", 0, 2097152, ...]``.
NOTE: because payloads are positional, a new field is only ever appended at the end with a
default; any other change bumps ``SCHEMA_VERSION`` and adds an upcaster in ``events.upcast``.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Union

import msgspec

from residency.events.checksums import pack_checksums, unpack_checksums  # noqa: F401  (MoveAcked's packing)

Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = ("device", "host", "disk")
MoveKind = Literal["spill", "evict", "park", "restore", "promote", "demote"]
MOVE_KINDS: tuple[str, ...] = ("spill", "evict", "park", "restore", "promote", "demote")
StrandedWhy = Literal["deadline", "worker_lost", "silent_release"]
DivergenceCaught = Literal["step", "ballot"]       # a group's ranks compared after a step ran, or before


class Event(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True, gc=False):
    SCHEMA_VERSION: ClassVar[int] = 1


# ---------------------------------------------------------------- server
class ServerStarted(Event):
    version: str
    config_digest: str


class ServerStopped(Event):
    reason: str


# ---------------------------------------------------------------- workers
class WorkerJoined(Event):
    worker: int
    device: str                       # "cuda:0", "cpu"
    tiers: dict[str, int]             # tier -> capacity_bytes
    block_bytes: int
    # device bytes outside the KV pool by owner ("weights", "scratch"): on the device's books,
    # never as blocks
    device_owned: dict[str, int] = {}
    # the limit of the worker's pinned budget (host pool and rings; None: not said): the bytes it may
    # pin without a host ceiling set
    pinned_limit_bytes: int | None = None
    # the tensor-parallel group it is a rank of ("" alone) and its rank there
    group: str = ""
    rank: int = 0


class WorkerHeartbeatMissed(Event):
    worker: int
    silent_ms: int


class WorkerLost(Event):
    """A worker is gone. The control process names the consequences from its fold: the blocks
    whose only copy was on it (``blocks_lost``/``bytes_lost``); its in-flight moves follow as
    ``MoveStranded(why="worker_lost")`` or ``MoveAbandoned`` events.

    ``kept_on_disk``: blocks the ledger had on this worker's disk whose files the incarnation that
    replaces it found and verified at its start (recorded when that one says Hello): their disk
    copy survives, every other copy of them is gone; they are not in ``blocks_lost``."""

    worker: int
    reason: str
    blocks_lost: list[int] = []
    bytes_lost: int = 0
    kept_on_disk: list[int] = []
    bytes_kept: int = 0


class WorkerWedged(Event):
    """A worker that answers its pings but whose engine made no step for ``stalled_ms`` while
    ``running`` requests ran on it (``deadline_ms``: the most a step may take, as judged then).
    Its requests are answered with a retryable error and it is given no new one until it
    progresses again (``WorkerResumed``)."""

    worker: int
    running: int                      # requests the control process had running on it
    last_step: int | None             # the worker's step counter, as last reported (None: never)
    stalled_ms: int
    deadline_ms: int
    request_ids: list[str] = []       # the requests answered for it


class WorkerResumed(Event):
    """A wedged worker progresses again: a step completed, or its engine turned with nothing
    left to run."""

    worker: int
    step: int | None                  # its step counter now
    wedged_ms: int                    # since the WorkerWedged


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


# ---------------------------------------------------------------- requests
class RequestAdmitted(Event):
    """A request was given its pages. ``shared_tokens``: leading prompt positions whose KV came
    from another session's resident pages (``shared_from``, its pages ``shared_blocks``), not
    prefilled: a request outside a session reads them in place and never owns them; a session's
    turn has them copied into its own new pages on the device (``copied``), so every page a
    session lists stays its own."""

    request_id: str
    session: str | None
    prompt_tokens: int
    shared_tokens: int = 0
    shared_from: str | None = None
    shared_blocks: list[int] = []
    copied: bool = False
    worker: int | None = None          # where it runs (None: recorded before workers were named here)
    routed_from: int | None = None     # the worker that tokenized it, when it moved for a shared prefix


class RequestRefused(Event):
    request_id: str
    reason: str


class RequestFinished(Event):
    request_id: str
    reason: str                       # "stop", "length", "disconnected", "error"
    completion_tokens: int


class RequestQueued(Event):
    """A request the scheduler could not admit yet waits for room; recorded once, when it starts
    waiting (not at each retry). It ends in ``RequestAdmitted``, ``RequestRefused`` (its wait timed
    out, its worker was lost, the server stopped) or ``RequestFinished`` (its client went away).
    ``waiting_for`` is the scheduler's reason in words; ``needed_blocks``/``free_blocks`` its
    device-page arithmetic when room is what it waits for (0/0 otherwise); ``parks`` the idle
    sessions whose park was asked to make that room."""

    request_id: str
    session: str | None
    worker: int
    prompt_tokens: int
    waiting_for: str
    needed_blocks: int = 0
    free_blocks: int = 0
    parks: list[str] = []


# ---------------------------------------------------------------- steps
class StepCompleted(Event):
    worker: int
    step: int
    batch_digest: str
    num_seqs: int
    num_tokens: int
    duration_ns: int
    decode_path: str = ""             # "graph" (a captured CUDA graph replayed) | "eager"; "": not said
    # time the step's forward waited for restored pages still landing (a pipelined restore), as the worker
    # measured it; None: the step waited for none (or it could not measure)
    restore_wait_ns: int | None = None
    # the digest of the step's block tables (each sequence's logical page ids, in batch order): the
    # ranks of a group compare it beside batch_digest; "": not said (a worker alone)
    tables_digest: str = ""


# ---------------------------------------------------------------- rebind
class RebindRequested(Event):
    rebind_id: str
    worker: int
    pool: str
    from_gen: int
    to_gen: int
    readers: list[str]


class ReaderStamped(Event):
    rebind_id: str
    reader: str
    gen: int


class RebindCommitted(Event):
    rebind_id: str


class RebindTorn(Event):
    rebind_id: str
    readers_behind: list[str]


class PoolResized(Event):
    worker: int
    pool: str
    from_bytes: int
    to_bytes: int
    gen: int
    # what the driver counts free after the resize less before (a grow: negative), as the worker
    # measured it; None: not measurable there (a CPU host), never 0 for "unknown"
    measured_freed_bytes: int | None = None


class RebindRefused(Event):
    """The pool's worker refused a rebind and changed nothing (``error`` says why, with its
    arithmetic: e.g. more than the card holds): the pool and every reader stay at ``from_gen``,
    usable. Closes the rebind without tearing it."""

    rebind_id: str
    worker: int
    error: str


# ---------------------------------------------------------------- weights and flip
class WeightsLoaded(Event):
    worker: int
    arena: str
    model: str
    bytes: int                         # the parameter tensors' nbytes, summed
    allocator_bytes: int | None = None  # the device allocator's growth over the load (None: not measured)
    # bytes of this model's image by tier ("device": in the arena, "host": a pinned image, "file": only
    # on disk) and the image's checksum (dataplane/flip/image.py ImageSums.total, hex; "" not computed)
    tier_bytes: dict[str, int] = {}
    checksum: str = ""


class FlipRequested(Event):
    """Written ahead of a ``SwapWeights`` command. ``action``: "flip" (the arena's image becomes
    ``to_model``), "sleep" (``to_model`` "": level 1 moves the image to pinned host, level 2 drops it)
    or "wake" (``from_model`` "": the image comes back from host, or from its file after a level-2
    sleep). Bytes are what the plan expects to move each way."""

    flip_id: str
    worker: int
    arena: str
    from_model: str
    to_model: str
    bytes_out: int
    bytes_in: int
    action: str = "flip"
    level: int = 0
    to_gen: int = 0
    deadline_ns: int = 0
    # a sleep: the worker's device KV pool bytes before the sleep shrank it, the size the wake grows
    # it back to (in the ledger so that a control restarted while asleep still knows it); None: the
    # sleep did not shrink the pool
    kv_pool_bytes: int | None = None


class FlipCompleted(Event):
    """What the worker measured (``WeightsSwapped``): bytes each way, overlap, wall time, both
    images' checksums. ``measured_freed_bytes``: device bytes the driver counts free afterwards less
    before (a sleep: positive, a wake: negative; None where not measurable, e.g. a CPU host)."""

    flip_id: str
    bytes_out: int
    bytes_in: int
    started_ns: int
    finished_ns: int
    overlapped_steps: int
    checksum_ok: bool
    worker: int = -1
    to_gen: int = 0
    dropped_bytes: int = 0
    steps: int = 0
    out_ns: int = 0
    in_ns: int = 0
    measured_freed_bytes: int | None = None


class FlipFailed(Event):
    """The flip did not happen, or was refused before a byte moved (``error`` with its arithmetic),
    or was abandoned (``stranded``: the worker died or missed the deadline; ``stranded_bytes``
    names the arena bytes whose image is then unknown, never 0 for unknown)."""

    flip_id: str
    error: str
    stranded: bool = False
    stranded_bytes: int | None = None


# ---------------------------------------------------------------- groups
class GroupDiverged(Event):
    """The ranks of a group disagree: the first step whose digests differ, every rank's digest
    keyed by its worker id. ``caught_by`` "step": the ranks' ``StepCompleted`` digests of a step
    that ran; "ballot": their ballots before the step (``round`` on the group's store), for
    ``request_id``: the step did not run on any rank."""

    group: str
    step: int
    digests_by_rank: dict[str, str]
    caught_by: DivergenceCaught = "step"
    round: int | None = None          # the ballot's round (None: not a ballot's)
    request_id: str = ""              # the sequence whose ballots differ ("": a whole step's digest)


class GroupStopped(Event):
    group: str
    reason: str
    # the step it stopped at (a divergence's onset; None: not a step's, e.g. a rank lost) and the
    # group's blocks the stop names (a lost rank's shard of each)
    step: int | None = None
    blocks: list[int] = []


# ---------------------------------------------------------------- outside tenants
class TenantReclaimed(Event):
    """An outside tenant was granted device memory: the moves ``moves`` emptied pool slots (the
    sessions ``sessions`` parked or dropped), then the dial shrank the device pool by
    ``granted_bytes`` (the ask, ``asked_bytes``, rounded up to whole pages) in rebind
    ``rebind_id``. ``freed_bytes``: device bytes the moves' answers said they freed (0 when the
    pool already had the room). ``measured_bytes``: what the driver counted free after the
    shrink less before (None: not measured, e.g. on a CPU host; never a guess)."""

    tenant: str
    worker: int
    asked_bytes: int
    granted_bytes: int
    freed_bytes: int
    measured_bytes: int | None
    rebind_id: str
    moves: list[str] = []
    sessions: list[str] = []


class TenantReclaimFailed(Event):
    """A reclaim that passed its arithmetic but did not end in a grant: a move it needed failed,
    was refused or stranded, or the dial refused the shrink. Nothing was granted; what moved
    stays where it landed (its own events say so). Also a release whose grow the dial did not
    commit (``reason`` starts with "release:"): the grant stays the tenant's. ``stranded_bytes``/``stranded_moves``: bytes
    at risk on the way, named, never counted as freed."""

    tenant: str
    worker: int
    asked_bytes: int
    reason: str
    moves: list[str] = []
    stranded_bytes: int = 0
    stranded_moves: list[str] = []


class TenantReleased(Event):
    """An outside tenant gave back ``bytes`` of its grant; the dial grew the device pool by them
    in rebind ``rebind_id``. ``measured_bytes``: what the driver counted taken by the grow (None:
    not measured)."""

    tenant: str
    worker: int
    bytes: int
    measured_bytes: int | None
    rebind_id: str


# ---------------------------------------------------------------- experts (an offloaded MoE model)
ExpertMoveKind = Literal["fetch", "prefetch", "evict"]
EXPERT_MOVE_KINDS: tuple[str, ...] = ("fetch", "prefetch", "evict")


class ExpertMove(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One expert of one layer moved between its pinned host copy and a device slot.

    fetch     copied host -> device because the step routed to it (the layer waited for it)
    prefetch  copied ahead of its layer, chosen by measured routing frequency (a side stream)
    evict     its device slot given to another expert; the host copy stays, nothing is copied

    ``ns``: the copy's measured time (None: not measured); an evict copies nothing and says 0."""

    kind: ExpertMoveKind
    layer: int
    expert: int
    bytes: int
    ns: int | None = None


class ExpertsMoved(Event):
    """The expert moves of one serving step of a worker whose MoE experts live in pinned host
    memory and visit a device budget of slots (``--expert-budget``). One event per step that moved
    anything (``step`` as ``StepCompleted.step``; 0: the placement at start), so the ledger grows
    by a row per step, not a row per expert.

    Every expert always has a host copy (``host_bytes``, all of them); ``device_bytes``: expert bytes
    in device slots after the step (the slots themselves are allocated once, on the device's books
    as weights). ``served_device_bytes``/``served_fetched_bytes``: bytes of the (layer, expert)
    pairs the step routed to that were already on the device (resident or prefetched) vs fetched
    for it on demand. ``num_layers``/``num_experts`` name the grid the moves index."""

    worker: int
    step: int
    moves: list[ExpertMove]
    fetched_bytes: int                # copied onto the device this step: Σ bytes of its fetches and prefetches
    device_bytes: int
    host_bytes: int
    served_device_bytes: int = 0
    served_fetched_bytes: int = 0
    num_layers: int = 0
    num_experts: int = 0


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
