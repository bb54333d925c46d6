"""``fold(state, recorded) -> state``: the one place where ledger events change state.

Deterministic and free of I/O, clocks and randomness: live state and replayed state hash the
same. For speed it updates the State it is given in place and returns it (a replay of a
million events cannot copy the state a million times); callers that need the old state keep
a snapshot (``control.state.encode_state``).

The fold never raises on a surprising event: a ledger that recorded something impossible is
exactly what an operator needs to replay. It notes the seq and what was impossible in
``state.anomalies`` and ``check_integrity()`` reports them.

Residency changes only on acked bytes: a MoveRequested books bytes in flight toward the
destination; the copy appears there (and the source copy goes, unless kept) only when a
MoveAcked or MoveLateAcked arrives.

Here: workers, budgets, pinned memory, blocks and moves. The serving side's events (sessions,
requests, steps, rebinds, weights arenas and flips) fold in control/fold_serving.py; the two
helpers both use are in control/fold_base.py.
"""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as ev
from residency.events.envelope import Recorded
from residency.control import fold_serving
from residency.control.fold_base import anomaly as _anomaly, worker_or_anomaly as _worker
from residency.control.state import (
    MAX_REFUSALS_KEPT,
    BlockState,
    copy_set,
    MoveState,
    RefusalSummary,
    SessionState,
    State,
    new_worker,
)


def fold(state: State, recorded: Recorded) -> State:
    """Apply one recorded event."""
    env = recorded.envelope
    return fold_decoded(state, ((env.seq, env.ts_ns, recorded.event),))


def fold_all(state: State, records) -> State:
    """Apply recorded events in order."""
    return fold_decoded(state, ((r.envelope.seq, r.envelope.ts_ns, r.event) for r in records))


def fold_decoded(state: State, triples) -> State:
    """Apply ``(seq, ts_ns, event)`` triples in order: the one loop every fold goes through
    (replay feeds it straight from raw rows, with no envelope objects)."""
    handler = _HANDLERS.get
    seq = ts = None
    for seq, ts, event in triples:
        handler(type(event), _ignore)(state, event, seq)
    if seq is not None:
        state.last_seq, state.last_ts_ns = seq, ts
    return state


def fold_run(state: State, first_seq: int, events, last_ts_ns: int) -> State:
    """Apply ``events`` whose seqs are ``first_seq, first_seq + 1, ...`` (a gapless run of the
    ledger, as replay reads it); ``last_ts_ns`` is the last one's time. Same effect as
    ``fold_decoded`` on the same events, without building a (seq, ts, event) triple per event
    (tests/control/test_fold.py checks they agree)."""
    handler = _HANDLERS.get
    seq = first_seq - 1
    for event in events:
        seq += 1
        handler(type(event), _ignore)(state, event, seq)
    if seq >= first_seq:
        state.last_seq, state.last_ts_ns = seq, last_ts_ns
    return state


def _ignore(s: State, e, seq: int) -> None:
    """Events the fold has nothing to do with (groups): they only advance last_seq."""


# ---------------------------------------------------------------------- helpers
def _add_copy(s: State, worker: int, block: int, tier: str, seq: int, session=None, key="") -> None:
    ws = s.workers[worker]
    blocks = s.blocks.setdefault(worker, {})
    b = blocks.get(block)
    if b is None:
        b = blocks[block] = BlockState(session=session, key=key, tiers=[])
    if tier in b.tiers:
        _anomaly(s, seq, f"block {block} already has a copy on {tier} of worker {worker}")
        return
    b.tiers.append(tier)
    if s.copies is not None:
        copy_set(s, worker, tier).add(block)
    ws.tiers[tier].used_bytes += ws.block_bytes


def _terminal(s: State, move_id: str, outcome: str, seq: int) -> MoveState | None:
    outcomes = s.outcomes
    if move_id in outcomes:
        _anomaly(s, seq, f"move {move_id} got {outcome} after its terminal {outcomes[move_id]}")
        return None
    mv = s.inflight.pop(move_id, None)
    if mv is None:
        _anomaly(s, seq, f"{outcome} for move {move_id} that was never requested")
        return None
    outcomes[move_id] = outcome
    num_moves = s.num_moves
    num_moves[outcome] = num_moves.get(outcome, 0) + 1
    ws = s.workers.get(mv.worker)
    if ws is not None:
        ws.tiers[mv.dst].inflight_in_bytes -= mv.bytes_planned
    return mv


def _apply_arrival(s: State, mv: MoveState, bytes_freed_src: int, checksum_ok: bool, seq: int) -> None:
    """The worker reported the copy done: the destination holds it; the source is freed unless kept."""
    ws = s.workers.get(mv.worker)
    if ws is None:
        return
    blocks = mv.blocks
    get = s.blocks.get(mv.worker, _NO_BLOCKS).get
    src, dst, drop, to_device = mv.src, mv.dst, not mv.keep_source, mv.dst == "device"
    # NOTE: the hot loop of every replay and of every big move's ack on the control loop (a 2 GiB
    # move names 1024 blocks). A block whose one copy is on the source (an evict, a restore of an
    # evicted block) ends with its one copy on the destination: rewriting that one-element list in
    # place is what the general steps below do to it (append dst, remove src), without the list
    # methods. Any other block takes the general steps. ``sole_src`` is None when the move keeps
    # its source (or names one tier twice): then no list equals it and every block goes the
    # general way. tests/control/test_fold.py compares both ways on random states.
    sole_src = [src] if drop and src != dst else None
    num_general = added = dropped = num_missing = 0
    for b in map(get, blocks):
        if b is None:
            num_missing += 1
            continue
        tiers = b.tiers
        if tiers == sole_src:
            tiers[0] = dst
        else:
            num_general += 1
            if dst not in tiers:
                tiers.append(dst)
                added += 1
            if drop and src in tiers:
                tiers.remove(src)
                dropped += 1
        if to_device and b.device_verified != checksum_ok:
            b.device_verified = checksum_ok
    if num_missing:     # named in block order; nothing above adds or removes a block
        for bid in blocks:
            if get(bid) is None:
                _anomaly(s, seq, f"move {mv.move_id} acked for block {bid} that no longer exists")
    num_sole = len(blocks) - num_missing - num_general
    if s.copies is not None:                        # the copy index, in C: what the lists now say
        present = blocks if not num_missing else [bid for bid in blocks if get(bid) is not None]
        copy_set(s, mv.worker, dst).update(present)
        if drop:
            copy_set(s, mv.worker, src).difference_update(present)
    accounts = ws.tiers
    accounts[dst].used_bytes += (added + num_sole) * ws.block_bytes
    src_account = accounts[src]
    src_account.used_bytes -= (dropped + num_sole) * ws.block_bytes
    src_account.reclaimed_bytes += bytes_freed_src


_NO_BLOCKS: dict = {}


# ---------------------------------------------------------------------- handlers
def _server_started(s: State, e: ev.ServerStarted, seq: int) -> None:
    s.server_up = True


def _server_stopped(s: State, e: ev.ServerStopped, seq: int) -> None:
    s.server_up = False


def _worker_joined(s: State, e: ev.WorkerJoined, seq: int) -> None:
    ws = s.workers.get(e.worker)
    if ws is None:
        s.workers[e.worker] = new_worker(e.worker, e.device, e.tiers, e.block_bytes)
        return
    # A worker coming back: same accounts, fresh capacities. Copies it lost were named by
    # the WorkerLost / BlocksFreed events before this one.
    ws.alive, ws.lost_reason, ws.device, ws.silent_ms = True, None, e.device, 0
    if ws.block_bytes != e.block_bytes and s.blocks.get(e.worker):
        _anomaly(s, seq, f"worker {e.worker} rejoined with block_bytes {e.block_bytes} != {ws.block_bytes} while holding blocks")
    ws.block_bytes = e.block_bytes
    for t, cap in e.tiers.items():
        ws.tiers[t].capacity_bytes = cap


def _heartbeat_missed(s: State, e: ev.WorkerHeartbeatMissed, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "WorkerHeartbeatMissed")
    if ws is not None:
        ws.silent_ms = e.silent_ms


def _worker_lost(s: State, e: ev.WorkerLost, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "WorkerLost")
    if ws is None:
        return
    ws.alive, ws.lost_reason = False, e.reason
    ws.bytes_lost += e.bytes_lost
    # Every copy lived in that worker's memory or disk: gone with it, but for the disk copies
    # its next incarnation found and verified (kept_on_disk).
    for t in ws.tiers.values():
        t.used_bytes = 0
    old = s.blocks.pop(e.worker, None) or {}
    if s.copies is not None:
        s.copies.pop(e.worker, None)
    ws.pinned = {}
    if e.kept_on_disk:
        kept = {}
        for bid in e.kept_on_disk:
            b = old.get(bid)
            if b is None or "disk" not in b.tiers:
                _anomaly(s, seq, f"WorkerLost keeps block {bid} of worker {e.worker}, which had no disk copy")
                continue
            b.tiers = ["disk"]
            kept[bid] = b
        if kept:
            s.blocks[e.worker] = kept
            ws.tiers["disk"].used_bytes = len(kept) * ws.block_bytes
            if s.copies is not None:
                copy_set(s, e.worker, "disk").update(kept)


def _budget_set(s: State, e: ev.BudgetSet, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "BudgetSet")
    if ws is not None:
        acc = ws.tiers[e.tier]
        acc.floor_bytes, acc.ceiling_bytes = e.floor_bytes, e.ceiling_bytes


def _pinned_registered(s: State, e: ev.PinnedRegistered, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "PinnedRegistered")
    if ws is not None:
        ws.pinned[e.owner] = ws.pinned.get(e.owner, 0) + e.bytes


def _pinned_released(s: State, e: ev.PinnedReleased, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "PinnedReleased")
    if ws is None:
        return
    left = ws.pinned.get(e.owner, 0) - e.bytes
    if left < 0:
        _anomaly(s, seq, f"worker {e.worker} released {e.bytes} pinned bytes of {e.owner}, more than registered")
        left = 0
    if left:
        ws.pinned[e.owner] = left
    else:
        ws.pinned.pop(e.owner, None)


def _blocks_committed(s: State, e: ev.BlocksCommitted, seq: int) -> None:
    worker, tier, session = e.worker, e.tier, e.session
    ws = _worker(s, worker, seq, "BlocksCommitted")
    if ws is None:
        return
    keys = e.keys if len(e.keys) == len(e.blocks) else [""] * len(e.blocks)
    blocks = s.blocks.setdefault(worker, {})
    added = 0
    get = blocks.get
    for bid, key in zip(e.blocks, keys):          # _add_copy, inlined: a hot loop of every replay
        b = get(bid)
        if b is None:                             # a new block: its one copy is this one
            blocks[bid] = BlockState(session=session, key=key, tiers=[tier])
            added += 1
            continue
        if tier in b.tiers:
            _anomaly(s, seq, f"block {bid} already has a copy on {tier} of worker {worker}")
            continue
        b.tiers.append(tier)
        added += 1
    if s.copies is not None:                        # the copy index (a block already there: no change)
        copy_set(s, worker, tier).update(e.blocks)
    ws.tiers[tier].used_bytes += added * ws.block_bytes
    if session is not None:
        sess = s.sessions.get(session)
        if sess is None:
            sess = s.sessions[session] = SessionState(session=session)
        sess.worker = worker


def _blocks_freed(s: State, e: ev.BlocksFreed, seq: int) -> None:
    ws = s.workers.get(e.worker)
    if ws is None:
        _anomaly(s, seq, f"BlocksFreed names unknown worker {e.worker}")
        return
    blocks = s.blocks.get(e.worker, _NO_BLOCKS)
    get = blocks.get
    tier, dropped = e.tier, 0
    for bid in e.blocks:
        b = get(bid)
        if b is None or tier not in b.tiers:
            _anomaly(s, seq, f"block {bid} has no copy on {tier} of worker {e.worker} to free")
            continue
        tiers = b.tiers
        tiers.remove(tier)
        dropped += 1
        if not tiers:
            del blocks[bid]
    if s.copies is not None:                        # the copy index (a block not there: no change)
        copy_set(s, e.worker, tier).difference_update(e.blocks)
    account = ws.tiers[tier]
    account.used_bytes -= dropped * ws.block_bytes
    account.reclaimed_bytes += e.bytes


def _move_requested(s: State, e: ev.MoveRequested, seq: int) -> None:
    move_id = e.move_id
    ws = s.workers.get(e.worker)
    if ws is None:
        _anomaly(s, seq, f"MoveRequested names unknown worker {e.worker}")
    inflight = s.inflight
    if move_id in inflight or move_id in s.outcomes:
        _anomaly(s, seq, f"move {move_id} requested twice")
        return
    # positional: MoveState's field order (the hot path of every replay)
    inflight[move_id] = MoveState(move_id, e.kind, e.worker, e.src, e.dst, list(e.blocks), e.bytes_planned,
                                  e.keep_source, e.deadline_ns, e.session, seq)
    if ws is not None:
        ws.tiers[e.dst].inflight_in_bytes += e.bytes_planned


def _move_dispatched(s: State, e: ev.MoveDispatched, seq: int) -> None:
    mv = s.inflight.get(e.move_id)
    if mv is None:
        _anomaly(s, seq, f"MoveDispatched for move {e.move_id} not in flight")
    else:
        mv.status = "dispatched"


def _move_acked(s: State, e: ev.MoveAcked, seq: int) -> None:
    mv = _terminal(s, e.move_id, "MoveAcked", seq)
    if mv is not None:
        _apply_arrival(s, mv, e.bytes_freed_src, e.checksum_ok, seq)


def _move_failed(s: State, e: ev.MoveFailed, seq: int) -> None:
    _terminal(s, e.move_id, "MoveFailed", seq)


def _move_rejected(s: State, e: ev.MoveRejected, seq: int) -> None:
    _terminal(s, e.move_id, "MoveRejected", seq)


def _move_abandoned(s: State, e: ev.MoveAbandoned, seq: int) -> None:
    _terminal(s, e.move_id, "MoveAbandoned", seq)


def _move_stranded(s: State, e: ev.MoveStranded, seq: int) -> None:
    mv = _terminal(s, e.move_id, "MoveStranded", seq)
    if mv is None:
        return
    mv.status = "stranded"
    s.stranded[e.move_id] = mv
    ws = s.workers.get(mv.worker)
    if ws is not None:
        ws.tiers[mv.src].stranded_bytes += e.bytes_at_risk
    # remember what was at risk so a late ack can re-account exactly that
    mv.bytes_planned = e.bytes_at_risk


def _move_late_acked(s: State, e: ev.MoveLateAcked, seq: int) -> None:
    mv = s.stranded.pop(e.move_id, None)
    if mv is None:
        _anomaly(s, seq, f"MoveLateAcked for move {e.move_id} that is not stranded")
        return
    s.outcomes[e.move_id] = "MoveLateAcked"
    s.num_moves["MoveLateAcked"] = s.num_moves.get("MoveLateAcked", 0) + 1
    ws = s.workers.get(mv.worker)
    if ws is not None:
        ws.tiers[mv.src].stranded_bytes -= mv.bytes_planned
        if ws.alive:
            _apply_arrival(s, mv, e.bytes_freed_src, e.checksum_ok, seq)


def _move_refused(s: State, e: ev.MoveRefused, seq: int) -> None:
    s.num_refusals += 1
    s.refusals.append(RefusalSummary(
        seq=seq, ask=e.ask, worker=e.worker, tier=e.tier, asked_bytes=e.asked_bytes,
        available_bytes=e.available_bytes, floor_bytes=e.floor_bytes, reason=e.reason,
    ))
    if len(s.refusals) > MAX_REFUSALS_KEPT:
        del s.refusals[0]


def _state_checkpoint(s: State, e: ev.StateCheckpoint, seq: int) -> None:
    s.checkpoints.append((seq, e.through_seq, e.state_hash))
    if len(s.checkpoints) > 16:
        del s.checkpoints[0]


_HANDLERS: dict[type, Callable[[State, object, int], None]] = {
    ev.ServerStarted: _server_started,
    ev.ServerStopped: _server_stopped,
    ev.WorkerJoined: _worker_joined,
    ev.WorkerHeartbeatMissed: _heartbeat_missed,
    ev.WorkerLost: _worker_lost,
    ev.BudgetSet: _budget_set,
    ev.PinnedRegistered: _pinned_registered,
    ev.PinnedReleased: _pinned_released,
    ev.BlocksCommitted: _blocks_committed,
    ev.BlocksFreed: _blocks_freed,
    ev.MoveRequested: _move_requested,
    ev.MoveDispatched: _move_dispatched,
    ev.MoveAcked: _move_acked,
    ev.MoveFailed: _move_failed,
    ev.MoveRejected: _move_rejected,
    ev.MoveRefused: _move_refused,
    ev.MoveStranded: _move_stranded,
    ev.MoveLateAcked: _move_late_acked,
    ev.MoveAbandoned: _move_abandoned,
    ev.StateCheckpoint: _state_checkpoint,
    **fold_serving.HANDLERS,
}
