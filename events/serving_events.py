"""The serving fleet's events: the server and its workers (joined, silent, lost, wedged), the
requests they admit, queue, refuse and finish, the steps they run, their tensor-parallel groups,
and the experts an offloaded MoE model moves each step. (The serving messages that never land in
the ledger are ``events.serving``.)

NOTE: a new field goes at the end of its class, with a default (``events.event`` says why); a new
class joins the union in ``events.catalog``.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from residency.events.event import Event


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


# ---------------------------------------------------------------- groups
DivergenceCaught = Literal["step", "ballot"]       # a group's ranks compared after a step ran, or before


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


__all__ = [
    "ServerStarted", "ServerStopped", "WorkerJoined", "WorkerHeartbeatMissed", "WorkerLost",
    "WorkerWedged", "WorkerResumed", "RequestAdmitted", "RequestRefused", "RequestFinished",
    "RequestQueued", "StepCompleted", "GroupDiverged", "GroupStopped", "ExpertsMoved", "ExpertMove",
    "ExpertMoveKind", "EXPERT_MOVE_KINDS",
]
