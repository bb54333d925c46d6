"""The authoritative state of every byte, as folded from the ledger.

Plain msgspec Structs so a state can be snapshotted (msgpack) and hashed deterministically.
``control.fold`` is the only code that changes a State; everything here only reads it.

What the state knows, per worker and tier: capacity, the copies resident there (their bytes
are *used*), bytes in flight toward it (counted on the destination only once acked), bytes
stranded, bytes reclaimed (as reported in acks). Per block: which tiers hold a copy and whether
its device copy is verified. Moves in flight, stranded moves awaiting a late ack, sessions,
requests, rebinds, weights arenas and flips.
"""
from __future__ import annotations

import hashlib

import msgspec

from residency.events.catalog import TIERS


class IntegrityError(AssertionError):
    """The folded state breaks an invariant; the message carries the numbers."""


class TierAccount(msgspec.Struct, kw_only=True):
    capacity_bytes: int = 0
    used_bytes: int = 0
    inflight_in_bytes: int = 0       # planned bytes of moves in flight toward this tier
    stranded_bytes: int = 0
    reclaimed_bytes: int = 0
    floor_bytes: int = 0
    ceiling_bytes: int = 0


class WorkerState(msgspec.Struct, kw_only=True):
    worker: int
    device: str
    block_bytes: int
    alive: bool = True
    lost_reason: str | None = None
    bytes_lost: int = 0
    silent_ms: int = 0
    tiers: dict[str, TierAccount] = {}
    pinned: dict[str, int] = {}       # owner -> pinned host bytes registered
    device_owned: dict[str, int] = {}  # owner -> device bytes outside the KV pool (weights, scratch)
    last_step: int = -1
    last_step_ts_ns: int = 0
    tenants: dict[str, int] = {}      # outside tenant -> device bytes granted it (TenantReclaimed less TenantReleased)


class BlockState(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    session: str | None
    key: str
    tiers: list[str]                  # tiers holding a copy, in the order they arrived
    device_verified: bool = True      # written on device, or restored with checksum_ok


class MoveState(msgspec.Struct, gc=False):
    """A move in flight (or stranded). Positional construction is allowed: the fold builds one per
    MoveRequested, the hottest allocation of a replay. gc=False here and on BlockState: they hold
    only strings, ints and lists of those, so they can never be part of a reference cycle, and the
    collector need not walk the hundreds of thousands a long replay keeps."""

    move_id: str
    kind: str
    worker: int
    src: str
    dst: str
    blocks: list[int]
    bytes_planned: int
    keep_source: bool
    deadline_ns: int
    session: str | None
    requested_seq: int
    status: str = "requested"         # requested | dispatched | stranded | lost (LOST)


# NOTE: a move whose worker was lost after it was requested. A byte is stranded once: the
# WorkerLost's bytes_lost names every block that was on the worker, so such a move's bytes at
# risk are not counted again in its tier's stranded_bytes (nor by the residency_stranded view).
LOST = "lost"


class SessionState(msgspec.Struct, kw_only=True):
    session: str
    worker: int | None = None
    parked_tier: str | None = None
    parked_bytes: int = 0
    num_parks: int = 0
    num_restores: int = 0
    restored_tokens: int = 0
    computed_tokens: int = 0
    num_tokens: int | None = None     # positions its pages held at its last commit (None: never said)


class RebindState(msgspec.Struct, kw_only=True):
    rebind_id: str
    worker: int
    pool: str
    from_gen: int
    to_gen: int
    readers: dict[str, int]           # reader -> generation it carries
    status: str = "requested"         # requested | committed | torn | refused (nothing changed) |
                                      # superseded (its worker's next incarnation has a new pool)


class ArenaState(msgspec.Struct, kw_only=True):
    """A worker's weights arena: the model whose image it holds (``model``; while ``asleep``, the
    one that slept), its generation, the flip in flight, and whether it is stranded (a flip that
    never answered: its bytes are unknown until a complete flip or wake)."""

    worker: int
    arena: str
    model: str
    bytes: int
    gen: int = 0
    flip_in_flight: str | None = None
    incoming_model: str | None = None
    asleep: bool = False
    sleep_level: int = 0
    action: str = ""                  # of the flip in flight: flip | sleep | wake
    deadline_ns: int = 0              # of the flip in flight (wall clock)
    inflight_bytes: int = 0           # the arena bytes at stake while it runs (the larger image)
    stranded: str | None = None       # the flip that left the arena's image unknown
    stranded_bytes: int = 0
    num_flips: int = 0                # completed flips, sleeps and wakes
    # the device KV pool bytes a sleep shrank the worker's pool from (FlipRequested.kv_pool_bytes):
    # the size the wake grows it back to; None once the pool was resized again (or never shrunk)
    kv_pool_bytes: int | None = None


class RefusalSummary(msgspec.Struct, kw_only=True, array_like=True):
    seq: int
    ask: str
    worker: int
    tier: str
    asked_bytes: int
    available_bytes: int
    floor_bytes: int
    reason: str


class State(msgspec.Struct, kw_only=True):
    # meta (not hashed): where the fold stands
    last_seq: int = 0
    last_ts_ns: int = 0
    checkpoints: list[tuple[int, int, str]] = []   # (seq, through_seq, state_hash)
    # hashed content
    server_up: bool = False
    workers: dict[int, WorkerState] = {}
    blocks: dict[int, dict[int, BlockState]] = {}  # worker -> block id -> state
    inflight: dict[str, MoveState] = {}
    stranded: dict[str, MoveState] = {}            # stranded, awaiting a possible late ack
    outcomes: dict[str, str] = {}                  # move_id -> terminal outcome name
    sessions: dict[str, SessionState] = {}
    requests: dict[str, int] = {}                  # request_id -> seq admitted (waiting or running)
    rebinds: dict[str, RebindState] = {}
    arenas: dict[str, ArenaState] = {}             # "worker:arena" -> arena
    flips: dict[str, str] = {}                     # flip_id in flight -> arena key
    refusals: list[RefusalSummary] = []            # the most recent ones (bounded)
    num_refusals: int = 0
    num_moves: dict[str, int] = {}                 # outcome -> count
    anomalies: list[tuple[int, str]] = []          # (seq, what was impossible)
    # derived, neither hashed nor in snapshots: worker -> tier -> ids of its blocks with a copy
    # there, so that a big move's ask is checked by set algebra instead of a lookup per block
    # (control/moves.py). None: not kept (a replay has no asks to check; keeping it costs a
    # replay ~12%); the control process builds it after recovery (``index_copies``) and from
    # then on the fold keeps it beside ``blocks``.
    copies: dict[int, dict[str, set[int]]] | None = None

    # ------------------------------------------------------------------ queries
    def tier(self, worker: int, tier: str) -> TierAccount:
        return self.workers[worker].tiers[tier]

    def stranded_bytes_total(self) -> int:
        return sum(w.bytes_lost for w in self.workers.values()) + sum(
            t.stranded_bytes for w in self.workers.values() for t in w.tiers.values()
        )

    def state_hash(self) -> str:
        return state_hash(self)

    def check_integrity(self) -> None:
        check_integrity(self)


MAX_REFUSALS_KEPT = 32
MAX_ANOMALIES_KEPT = 100

# NOTE: dict order is insertion order, and every fold inserts in ledger order, so two states
# folded from the same events (live, replayed, or resumed from a snapshot, which keeps order)
# encode to the same bytes. Sorting is not an option: msgspec sorts str keys only.
_hash_encoder = msgspec.msgpack.Encoder()
_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(State)


# The version of the fold, written into every state hash ("f7:<sha256>"). A StateCheckpoint from
# another version hashed another state, so it cannot be compared with this fold's replay; `ledger
# verify` says how many it left. Version 1 (the bare hex of earlier ledgers): before
# SessionState.num_tokens, and before a stranding whose worker is lost counted under the loss.
# Version 3: WorkerState.device_owned (the weights and scratch on the device's books).
# Version 4: a rebind refused by its worker, and a worker's open rebinds closed when a new
# incarnation joins (control/fold_serving.py). Version 5: outside tenants' grants
# (WorkerState.tenants). Version 6: a weights arena asleep or stranded, and the flip in flight's
# action, deadline and bytes (ArenaState; issue #28). Version 7: the KV pool size a sleep shrank
# the worker's pool from (ArenaState.kv_pool_bytes), which the wake grows it back to.
FOLD_VERSION = 7
_HASH_PREFIX = f"f{FOLD_VERSION}:"


def state_hash(state: State) -> str:
    """SHA-256 of the state's content (not of where the fold stands: last_seq, checkpoints),
    prefixed with the fold's version."""
    content = msgspec.structs.replace(state, last_seq=0, last_ts_ns=0, checkpoints=[], copies=None)
    return _HASH_PREFIX + hashlib.sha256(_hash_encoder.encode(content)).hexdigest()


def this_fold(digest: str) -> bool:
    """A state hash this fold can reproduce (written by the same fold version)."""
    return digest.startswith(_HASH_PREFIX)


def encode_state(state: State) -> bytes:
    return _snapshot_encoder.encode(msgspec.structs.replace(state, copies=None))


def decode_state(data: bytes) -> State:
    return _snapshot_decoder.decode(data)


def index_copies(state: State) -> State:
    """(Re)build ``state.copies`` from ``state.blocks``: from now on the fold keeps it. Returns
    the state."""
    state.copies = {}
    for w, blocks in state.blocks.items():
        for bid, b in blocks.items():
            for t in b.tiers:
                copy_set(state, w, t).add(bid)
    return state


def copy_set(state: State, worker: int, tier: str) -> set[int]:
    """The copy index's set of ``worker``'s blocks with a copy on ``tier``, made if new (the index
    must be kept: ``state.copies`` not None)."""
    per = state.copies.get(worker)
    if per is None:
        per = state.copies[worker] = {}
    on = per.get(tier)
    if on is None:
        on = per[tier] = set()
    return on


_NO_IDS: frozenset[int] = frozenset()


def copies_on(state: State, worker: int, tier: str) -> set[int] | frozenset[int]:
    """What the copy index says ``worker`` holds on ``tier``; empty when it is not kept, so a
    check that needs the blocks to be in it fails and its caller takes the per-block way."""
    return ((state.copies or {}).get(worker) or {}).get(tier, _NO_IDS)


def check_integrity(state: State) -> None:
    """Raise IntegrityError naming every broken invariant with its numbers."""
    problems: list[str] = []
    for w, ws in state.workers.items():
        expected = {t: 0 for t in ws.tiers}
        for bid, b in state.blocks.get(w, {}).items():
            if len(set(b.tiers)) != len(b.tiers):
                problems.append(f"worker {w} block {bid}: duplicate copies {b.tiers}")
            if not b.tiers:
                problems.append(f"worker {w} block {bid}: freed everywhere but still listed")
            for t in b.tiers:
                expected[t] = expected.get(t, 0) + ws.block_bytes
        for t, acc in ws.tiers.items():
            if acc.used_bytes != expected.get(t, 0):
                problems.append(
                    f"worker {w} {t}: used_bytes {acc.used_bytes} != copies x block_bytes {expected.get(t, 0)}"
                )
            if acc.capacity_bytes and acc.used_bytes > acc.capacity_bytes:
                problems.append(f"worker {w} {t}: used {acc.used_bytes} > capacity {acc.capacity_bytes}")
            if min(acc.used_bytes, acc.inflight_in_bytes, acc.stranded_bytes, acc.reclaimed_bytes) < 0:
                problems.append(f"worker {w} {t}: negative account {acc}")
        for owner, b in ws.pinned.items():
            if b < 0:
                problems.append(f"worker {w}: pinned bytes of {owner} negative ({b})")
        for tenant, b in ws.tenants.items():
            if b <= 0:
                problems.append(f"worker {w}: outside tenant {tenant} holds {b} bytes (a grant is > 0 or gone)")
    want = index_copies(msgspec.structs.replace(state)).copies if state.copies is not None else {}
    for w in set(want) | set(state.copies or {}):
        for t in set(want.get(w, {})) | set(state.copies.get(w, {})):
            have, need = state.copies.get(w, {}).get(t, set()), want.get(w, {}).get(t, set())
            if have != need:
                problems.append(f"worker {w} {t}: the copy index says {sorted(have ^ need)[:8]} wrongly")
    for mid in state.inflight:
        if mid in state.outcomes:
            problems.append(f"move {mid} in flight but already has outcome {state.outcomes[mid]}")
    at_risk: dict[tuple[int, str], int] = {}
    for mid, mv in state.stranded.items():
        if state.outcomes.get(mid) != "MoveStranded":
            problems.append(f"move {mid} listed stranded but outcome is {state.outcomes.get(mid)}")
        if mv.status != LOST:
            at_risk[(mv.worker, mv.src)] = at_risk.get((mv.worker, mv.src), 0) + mv.bytes_planned
    for w, ws in state.workers.items():
        for t, acc in ws.tiers.items():
            if acc.stranded_bytes != at_risk.get((w, t), 0):
                problems.append(f"worker {w} {t}: stranded_bytes {acc.stranded_bytes} != bytes at risk of its "
                                f"stranded moves {at_risk.get((w, t), 0)} (a lost worker's are in its bytes_lost)")
    for rb in state.rebinds.values():
        if rb.status == "committed":
            behind = [r for r, g in rb.readers.items() if g != rb.to_gen]
            if behind:
                problems.append(f"rebind {rb.rebind_id} committed with readers behind: {behind}")
    for fid, key in state.flips.items():
        arena = state.arenas.get(key)
        if arena is None or arena.flip_in_flight != fid:
            problems.append(f"flip {fid} in flight on arena {key}, which names "
                            f"{arena.flip_in_flight if arena else 'no arena'}")
    for seq, what in state.anomalies:
        problems.append(f"seq {seq}: {what}")
    if problems:
        raise IntegrityError("; ".join(problems[:20]) + (f" (+{len(problems) - 20} more)" if len(problems) > 20 else ""))


def new_worker(worker: int, device: str, tiers: dict[str, int], block_bytes: int) -> WorkerState:
    return WorkerState(
        worker=worker,
        device=device,
        block_bytes=block_bytes,
        tiers={t: TierAccount(capacity_bytes=tiers.get(t, 0)) for t in TIERS},
    )
