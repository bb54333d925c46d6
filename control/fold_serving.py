"""The fold of the serving side's events: sessions parked and restored, requests admitted and
done, batch steps, rebinds of a pool, weights arenas and their flips. Deterministic, no I/O, never
raises on a surprising event (an anomaly is noted instead); ``control.fold`` dispatches here."""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as ev
from residency.control.fold_base import anomaly as _anomaly, worker_or_anomaly as _worker
from residency.control.state import ArenaState, RebindState, SessionState, State

def _session(s: State, name: str) -> SessionState:
    sess = s.sessions.get(name)
    if sess is None:
        sess = s.sessions[name] = SessionState(session=name)
    return sess


def _session_parked(s: State, e: ev.SessionParked, seq: int) -> None:
    sess = _session(s, e.session)
    sess.worker, sess.parked_tier, sess.parked_bytes = e.worker, e.tier, e.bytes
    sess.num_parks += 1


def _session_restored(s: State, e: ev.SessionRestored, seq: int) -> None:
    sess = _session(s, e.session)
    sess.worker, sess.parked_tier, sess.parked_bytes = e.worker, None, 0
    sess.num_restores += 1
    sess.restored_tokens += e.restored_tokens
    sess.computed_tokens += e.computed_tokens


def _session_deleted(s: State, e: ev.SessionDeleted, seq: int) -> None:
    s.sessions.pop(e.session, None)       # its pages were freed by the releases recorded before it


def _request_admitted(s: State, e: ev.RequestAdmitted, seq: int) -> None:
    s.requests[e.request_id] = seq
    if e.session is not None:
        _session(s, e.session)


def _request_done(s: State, e, seq: int) -> None:
    s.requests.pop(e.request_id, None)


def _step_completed(s: State, e: ev.StepCompleted, seq: int) -> None:
    ws = s.workers.get(e.worker)
    if ws is not None:
        ws.last_step = e.step


def _rebind_requested(s: State, e: ev.RebindRequested, seq: int) -> None:
    s.rebinds[e.rebind_id] = RebindState(
        rebind_id=e.rebind_id, worker=e.worker, pool=e.pool, from_gen=e.from_gen,
        to_gen=e.to_gen, readers={r: e.from_gen for r in e.readers},
    )


def _reader_stamped(s: State, e: ev.ReaderStamped, seq: int) -> None:
    rb = s.rebinds.get(e.rebind_id)
    if rb is None or e.reader not in rb.readers:
        _anomaly(s, seq, f"ReaderStamped {e.reader} for unknown rebind {e.rebind_id}")
        return
    rb.readers[e.reader] = e.gen


def _rebind_committed(s: State, e: ev.RebindCommitted, seq: int) -> None:
    rb = s.rebinds.get(e.rebind_id)
    if rb is None:
        _anomaly(s, seq, f"RebindCommitted for unknown rebind {e.rebind_id}")
        return
    behind = sorted(r for r, g in rb.readers.items() if g != rb.to_gen)
    if behind:
        _anomaly(s, seq, f"rebind {e.rebind_id} committed while readers {behind} are behind gen {rb.to_gen}")
    rb.status = "committed"


def _rebind_torn(s: State, e: ev.RebindTorn, seq: int) -> None:
    rb = s.rebinds.get(e.rebind_id)
    if rb is not None and rb.status != "superseded":    # a pool gone with its worker stays gone
        rb.status = "torn"


def _rebind_refused(s: State, e: ev.RebindRefused, seq: int) -> None:
    rb = s.rebinds.get(e.rebind_id)
    if rb is None:
        _anomaly(s, seq, f"RebindRefused for unknown rebind {e.rebind_id}")
        return
    rb.status = "refused"             # nothing changed: every reader is still at from_gen


def close_rebinds_of(s: State, worker: int) -> None:
    """A new incarnation of ``worker`` joined with a new pool: the rebinds of the old one's pool
    (pending or torn) name memory that is gone, so they no longer hold the worker's pool."""
    for rb in s.rebinds.values():
        if rb.worker == worker and rb.status in ("requested", "torn"):
            rb.status = "superseded"


def _pool_resized(s: State, e: ev.PoolResized, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "PoolResized")
    if ws is not None and e.pool in ws.tiers:
        ws.tiers[e.pool].capacity_bytes = e.to_bytes
    if e.pool == "device":            # resized again (the wake's grow, or ``ctl resize``): nothing to regrow;
        for arena in s.arenas.values():   # a sleep's own shrink comes before its FlipRequested sets it
            if arena.worker == e.worker:
                arena.kv_pool_bytes = None


def _weights_loaded(s: State, e: ev.WeightsLoaded, seq: int) -> None:
    key = f"{e.worker}:{e.arena}"
    prior = s.arenas.get(key)
    if prior is not None and prior.flip_in_flight:     # a new incarnation loaded its own image: the old
        s.flips.pop(prior.flip_in_flight, None)        # one's flip names memory that is gone
    s.arenas[key] = ArenaState(worker=e.worker, arena=e.arena, model=e.model, bytes=e.bytes,
                               gen=(prior.gen + 1) if prior else 0)


def _flip_requested(s: State, e: ev.FlipRequested, seq: int) -> None:
    key = f"{e.worker}:{e.arena}"
    arena = s.arenas.get(key)
    if arena is None:
        _anomaly(s, seq, f"flip {e.flip_id} on unknown arena {key}")
        return
    arena.flip_in_flight = e.flip_id
    # a wake names no model: the image that slept comes back
    arena.incoming_model = e.to_model or (arena.model if e.action == "wake" else "")
    arena.action = e.action
    arena.deadline_ns = e.deadline_ns
    arena.inflight_bytes = max(arena.bytes, e.bytes_in, e.bytes_out)
    if e.action == "sleep":
        arena.sleep_level = e.level   # the level it will sleep at, once completed (asleep says whether it does)
        if e.kv_pool_bytes is not None:   # the size its wake grows the KV pool back to
            arena.kv_pool_bytes = e.kv_pool_bytes
    s.flips[e.flip_id] = key


def _flip_completed(s: State, e: ev.FlipCompleted, seq: int) -> None:
    key = s.flips.pop(e.flip_id, None)
    arena = s.arenas.get(key) if key else None
    if arena is None:
        _anomaly(s, seq, f"FlipCompleted for unknown flip {e.flip_id}")
        return
    action = arena.action or "flip"
    if action == "sleep":             # the arena holds no image; ``model`` names the one to wake
        arena.asleep = True
    else:
        arena.model = arena.incoming_model or arena.model
        arena.asleep, arena.sleep_level = False, 0
        arena.bytes = e.bytes_in or arena.bytes
    arena.flip_in_flight, arena.incoming_model, arena.action = None, None, ""
    arena.deadline_ns = arena.inflight_bytes = 0
    arena.stranded, arena.stranded_bytes = None, 0     # a complete flip or wake repairs a stranded arena
    arena.gen = e.to_gen if e.to_gen > arena.gen else arena.gen + 1
    arena.num_flips += 1


def _flip_failed(s: State, e: ev.FlipFailed, seq: int) -> None:
    key = s.flips.pop(e.flip_id, None)
    arena = s.arenas.get(key) if key else None
    if arena is None:
        return                        # a flip refused before it was requested names no arena
    at_stake = arena.inflight_bytes
    if not arena.asleep:
        arena.sleep_level = 0
    arena.flip_in_flight, arena.incoming_model, arena.action = None, None, ""
    arena.deadline_ns = arena.inflight_bytes = 0
    if e.stranded:                    # nobody knows which image the arena holds now
        arena.stranded = e.flip_id
        arena.stranded_bytes = e.stranded_bytes if e.stranded_bytes is not None else at_stake


HANDLERS: dict[type, Callable[[State, object, int], None]] = {
    ev.SessionParked: _session_parked,
    ev.SessionRestored: _session_restored,
    ev.SessionDeleted: _session_deleted,
    ev.RequestAdmitted: _request_admitted,
    ev.RequestRefused: _request_done,
    ev.RequestFinished: _request_done,
    ev.StepCompleted: _step_completed,
    ev.RebindRequested: _rebind_requested,
    ev.ReaderStamped: _reader_stamped,
    ev.RebindCommitted: _rebind_committed,
    ev.RebindTorn: _rebind_torn,
    ev.PoolResized: _pool_resized,
    ev.RebindRefused: _rebind_refused,
    ev.WeightsLoaded: _weights_loaded,
    ev.FlipRequested: _flip_requested,
    ev.FlipCompleted: _flip_completed,
    ev.FlipFailed: _flip_failed,
}
