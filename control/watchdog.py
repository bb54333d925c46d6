"""The watchdog: deadlines, silence, and what a lost worker takes with it. Pure.

Every function takes the state and the time and returns the events to record; the control process
records them. Nothing here reads a clock.

    deadline passed, no answer        -> MoveStranded(why="deadline"), or "silent_release" for a
                                         release; its bytes stay listed as stranded until a late
                                         ack (MoveLateAcked) re-accounts them
    requested, never dispatched       -> MoveAbandoned (the worker never saw it; nothing moved)
    worker silent > missed_after      -> WorkerHeartbeatMissed (once per silence)
    flip past its deadline, or its     -> FlipFailed(stranded, the arena bytes at stake) and the
    worker gone                          rebind of its readers torn (``overdue_flips``)
    worker silent > lost_after,       -> WorkerLost naming every block that lived on it, then for
    or its process exited                each of its moves: MoveStranded(why="worker_lost") if it
                                         was dispatched (bytes may be half-copied), MoveAbandoned
                                         if it never left the control process
"""
from __future__ import annotations

from collections.abc import Collection

from residency.events import catalog as ev
from residency.control.state import MoveState, State


def is_release(mv: MoveState) -> bool:
    return mv.src == mv.dst


def overdue(state: State, now_ns: int, undispatched: Collection[str] = (),
            spare_workers: Collection[int] = ()) -> list[ev.Event]:
    """Terminal events for in-flight moves whose deadline has passed.

    ``spare_workers``: workers whose moves are being reconciled (after a control restart) and
    must not be stranded while their report is on its way.
    """
    out: list[ev.Event] = []
    for mv in state.inflight.values():
        if mv.deadline_ns >= now_ns or mv.worker in spare_workers:
            continue
        if mv.move_id in undispatched:
            out.append(ev.MoveAbandoned(move_id=mv.move_id, worker=mv.worker,
                                        why="deadline passed before the command could be sent"))
        else:
            out.append(ev.MoveStranded(move_id=mv.move_id, worker=mv.worker, bytes_at_risk=mv.bytes_planned,
                                       why="silent_release" if is_release(mv) else "deadline"))
    return out


def next_deadline_ns(state: State) -> int | None:
    return min((mv.deadline_ns for mv in state.inflight.values()), default=None)


def silence(last_heard_ns: dict[int, int], now_ns: int, missed_after_ns: int, lost_after_ns: int,
            already_missed: Collection[int]) -> tuple[list[ev.WorkerHeartbeatMissed], list[tuple[int, int]]]:
    """(heartbeat-missed events to record, [(worker, silent_ms)] to declare lost)."""
    missed, lost = [], []
    for w, heard in last_heard_ns.items():
        silent = now_ns - heard
        if silent > lost_after_ns:
            lost.append((w, silent // 1_000_000))
        elif silent > missed_after_ns and w not in already_missed:
            missed.append(ev.WorkerHeartbeatMissed(worker=w, silent_ms=silent // 1_000_000))
    return missed, lost


def loss(state: State, worker: int, reason: str, undispatched: Collection[str] = (),
         kept_on_disk: Collection[int] = ()) -> list[ev.Event]:
    """WorkerLost with its consequences named per block and per move, in the order to record them.
    ``kept_on_disk``: disk copies the next incarnation found and verified (only those the ledger
    has on that disk are kept)."""
    ws = state.workers.get(worker)
    if ws is None or not ws.alive:
        return []
    wb = state.blocks.get(worker, {})
    kept = sorted(b for b in set(kept_on_disk) if b in wb and "disk" in wb[b].tiers)
    kept_set = set(kept)
    blocks = sorted(b for b in wb if b not in kept_set)
    out: list[ev.Event] = [ev.WorkerLost(worker=worker, reason=reason, blocks_lost=blocks,
                                         bytes_lost=len(blocks) * ws.block_bytes, kept_on_disk=kept,
                                         bytes_kept=len(kept) * ws.block_bytes)]
    for mv in state.inflight.values():
        if mv.worker != worker:
            continue
        if mv.move_id in undispatched:
            out.append(ev.MoveAbandoned(move_id=mv.move_id, worker=worker,
                                        why=f"worker lost before dispatch: {reason}"))
        else:
            out.append(ev.MoveStranded(move_id=mv.move_id, worker=worker, bytes_at_risk=mv.bytes_planned,
                                       why="worker_lost"))
    return out


def overdue_flips(state: State, now_ns: int) -> list[tuple[str, str]]:
    """(flip_id, why) of each flip in flight past its deadline (wall clock, ``FlipRequested``'s
    ``deadline_ns``) or whose worker is gone: its arena is stranded (``control/flip.py stranded``).
    A deadline of 0 was never set: only the worker's loss strands that flip."""
    out = []
    for fid, key in state.flips.items():
        arena = state.arenas.get(key)
        if arena is None:
            continue
        ws = state.workers.get(arena.worker)
        if ws is None or not ws.alive:
            out.append((fid, f"worker {arena.worker} was lost with {arena.action or 'flip'} {fid} in flight"))
        elif arena.deadline_ns and now_ns > arena.deadline_ns:
            out.append((fid, f"no answer to {arena.action or 'flip'} {fid} by its deadline "
                             f"({(now_ns - arena.deadline_ns) // 1_000_000} ms ago)"))
    return out
