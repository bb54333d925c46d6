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

Here: the loop, workers, budgets, pinned memory and blocks. Moves and their outcomes fold in
control/fold_moves.py; the serving side's events (sessions, requests, steps, rebinds, weights
arenas and flips) in control/fold_serving.py; the helpers they share are in control/fold_base.py.
"""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as ev
from residency.events.envelope import Recorded
from residency.control import fold_moves, fold_serving, fold_tenants
from residency.control.fold_base import anomaly as _anomaly, free_copies, worker_or_anomaly as _worker
from residency.control.fold_moves import lose_moves
from residency.control.fold_serving import close_rebinds_of
from residency.control.state import (
    BlockState,
    copy_set,
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


# ---------------------------------------------------------------------- handlers
def _server_started(s: State, e: ev.ServerStarted, seq: int) -> None:
    s.server_up = True


def _server_stopped(s: State, e: ev.ServerStopped, seq: int) -> None:
    s.server_up = False


def _worker_joined(s: State, e: ev.WorkerJoined, seq: int) -> None:
    ws = s.workers.get(e.worker)
    if ws is None:
        s.workers[e.worker] = ws = new_worker(e.worker, e.device, e.tiers, e.block_bytes)
        ws.device_owned = dict(e.device_owned)
        return
    close_rebinds_of(s, e.worker)
    # A worker coming back: same accounts, fresh capacities. Copies it lost were named by
    # the WorkerLost / BlocksFreed events before this one.
    ws.alive, ws.lost_reason, ws.device, ws.silent_ms = True, None, e.device, 0
    if ws.block_bytes != e.block_bytes and s.blocks.get(e.worker):
        _anomaly(s, seq, f"worker {e.worker} rejoined with block_bytes {e.block_bytes} != {ws.block_bytes} while holding blocks")
    ws.block_bytes = e.block_bytes
    for t, cap in e.tiers.items():
        ws.tiers[t].capacity_bytes = cap
    ws.device_owned = dict(e.device_owned)


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
    lose_moves(s, ws)
    # Every copy lived in that worker's memory or disk: gone with it, but for the disk copies
    # its next incarnation found and verified (kept_on_disk).
    for t in ws.tiers.values():
        t.used_bytes = 0
    old = s.blocks.pop(e.worker, None) or {}
    if s.copies is not None:
        s.copies.pop(e.worker, None)
    ws.pinned = {}
    ws.device_owned = {}
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
        if e.session_tokens is not None:
            sess.num_tokens = e.session_tokens


def _blocks_freed(s: State, e: ev.BlocksFreed, seq: int) -> None:
    free_copies(s, e.worker, e.tier, e.blocks, e.bytes, seq, "BlocksFreed")


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
    ev.StateCheckpoint: _state_checkpoint,
    **fold_moves.HANDLERS,
    **fold_serving.HANDLERS,
    **fold_tenants.HANDLERS,
}
