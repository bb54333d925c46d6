"""Restart = replay to the end, then reconcile the moves in flight with the workers.

    replay(store)      the state (from the newest good snapshot plus the tail), the recency the
                       policies need, the roster (which incarnation of each worker the ledger
                       last saw join) and the next control epoch
    reconcile(...)     a worker's MovesReport -> the events that settle the moves we queried

A worker that comes back after a control restart says Hello with its epoch. The ledger records
each join with ``causation = "hello:w<N>@<epoch>"``; the same epoch means the same process with
the same memory, so it is adopted as is (no new WorkerJoined) and queried about which of our moves it
completed. Another epoch means the incarnation the ledger knew is gone: WorkerLost first.
A worker that does not come back within the grace is lost (see ``control.watchdog.loss``).

What a report settles (``reconcile``):
    in flight, the worker has its outcome        -> that outcome (MoveAcked / MoveFailed / MoveRejected)
    in flight, the worker never saw it           -> MoveAbandoned (the worker tombstones the id, so
                                                    a command still in a pipe is refused, never run)
    stranded, the worker acked it                -> MoveLateAcked (re-accounts the stranded bytes)
    stranded, the worker rejected it or failed   -> MoveLateFailed (its bytes are no longer at risk)
    in flight, not in the report                 -> still running there: its ack will come

Requests admitted and never finished were served by the process that is gone: each is closed with
``RequestFinished(reason="control_lost")`` (``orphaned_requests``); a surviving worker still
generating one is told to cancel it when its next tokens come (control/scheduler/streams.py).
"""
from __future__ import annotations

import time

import msgspec
import structlog

from residency.events import catalog as ev
from residency.events.commands import MovesReport
from residency.control import moves
from residency.control.fold import fold
from residency.control.policy.recency import Recency
from residency.control.replay import usable_snapshot
from residency.control.state import State

log = structlog.get_logger("control.recovery")
PRODUCER = "control"


class Recovered(msgspec.Struct, kw_only=True):
    state: State
    recency: Recency
    roster: dict[int, int]            # worker -> epoch of its last WorkerJoined
    last_seq: int
    epoch: int                        # this incarnation's epoch (greater than any before)
    num_replayed: int
    from_snapshot: int                # through_seq of the snapshot used (0 = none)
    crashed: bool                     # the last incarnation did not record ServerStopped


def join_causation(worker: int, epoch: int) -> str:
    return f"hello:w{worker}@{epoch}"


def parse_join_causation(causation: str | None) -> tuple[int, int] | None:
    if not causation or not causation.startswith("hello:w") or "@" not in causation:
        return None
    w, _, e = causation[len("hello:w"):].partition("@")
    return (int(w), int(e)) if w.isdigit() and e.isdigit() else None


def replay(store, use_snapshot: bool = True) -> Recovered:
    last = store.last_seq()
    state, start, snap_seq = State(), 1, 0
    if use_snapshot and last:
        state, snap_seq = usable_snapshot(store, last)
        start = snap_seq + 1
    recency = Recency()
    n = 0
    for rec in store.read(start, last):
        recency.observe(state, rec.event, rec.envelope.ts_ns)
        fold(state, rec)
        n += 1
    roster, max_epoch = _scan_roster(store, last)
    return Recovered(state=state, recency=recency, roster=roster, last_seq=last,
                     epoch=next_epoch(max_epoch, time.time_ns() // 1_000_000), num_replayed=n,
                     from_snapshot=snap_seq, crashed=state.server_up)


def _scan_roster(store, last: int) -> tuple[dict[int, int], int]:
    """Worker joins and control epochs from the raw rows (no payload decoding: cheap)."""
    roster: dict[int, int] = {}
    max_epoch = 0
    for rows in store.raw_batches(1, last):
        for r in rows:
            if r[2] == PRODUCER and r[3] > max_epoch:
                max_epoch = r[3]
            if r[5] == "WorkerJoined":
                parsed = parse_join_causation(r[8])
                if parsed is not None:
                    roster[parsed[0]] = parsed[1]
    return roster, max_epoch


def next_epoch(max_seen: int, now_ms: int) -> int:
    """Strictly greater than every epoch this producer used: (producer, epoch, producer_seq)
    is the ledger's idempotence key, so reusing an epoch would make new events look like retries."""
    return max(max_seen + 1, now_ms)


CONTROL_LOST = "control_lost"


def orphaned_requests(state: State) -> list[ev.RequestFinished]:
    """A RequestFinished for every request the ledger has admitted and not finished: the process
    that served them is gone, and nobody waits for them any more (their HTTP connections died with
    it). Recorded at start, after ServerStarted. ``completion_tokens`` is 0: the ledger records a
    request's tokens only in its RequestFinished, which never came."""
    return [ev.RequestFinished(request_id=rid, reason=CONTROL_LOST, completion_tokens=0) for rid in state.requests]


def to_query(state: State, worker: int, book: moves.MoveBook) -> list[str]:
    """The moves to query a (re)joining worker about: those in flight that this incarnation did
    not send itself, and the stranded ones still waiting for a late ack."""
    queried = [mid for mid, mv in state.inflight.items() if mv.worker == worker and not book.ours(mid)]
    queried += [mid for mid, mv in state.stranded.items() if mv.worker == worker]
    return queried


def reconcile(state: State, worker: int, report: MovesReport, queried: list[str]) -> list[tuple[str, ev.Event]]:
    """(verdict, event) for every move the report settles; verdicts as in ``control.moves``."""
    out: list[tuple[str, ev.Event]] = []
    for outcome in report.outcomes:
        verdict, event = moves.classify(state, worker, outcome)
        if event is not None:
            out.append((verdict, event))
    queried_set = set(queried)
    for mid in report.unknown:
        mv = state.inflight.get(mid)
        if mid in queried_set and mv is not None and mv.worker == worker:
            out.append((moves.TERMINAL, ev.MoveAbandoned(
                move_id=mid, worker=worker, why="the worker never received the command (control restarted)")))
    return out
