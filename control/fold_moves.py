"""The fold of moves: a request books bytes in flight toward the destination; its outcome settles
them. Only an ack (MoveAcked, or MoveLateAcked after a stranding) changes where copies are: the
destination gains its copy and the source loses its own unless the move keeps it. A stranding's
other late answer, MoveLateFailed, only releases the bytes it had put at risk. Part of the fold
(control/fold.py): deterministic, no I/O; a surprising event is noted as an anomaly, never raised.
"""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as ev
from residency.control.fold_base import NO_BLOCKS as _NO_BLOCKS, anomaly as _anomaly, free_copies
from residency.control.state import LOST, MAX_REFUSALS_KEPT, MoveState, RefusalSummary, State, WorkerState, copy_set


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
    elif mv.status != LOST:
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


def lose_moves(s: State, ws: WorkerState) -> None:
    """A WorkerLost: every byte that was on the worker is counted once, in its ``bytes_lost``.
    Its moves in flight (they will be stranded or abandoned next) and its stranded moves are
    marked LOST, and a stranded one's bytes leave the tier's stranded account: their blocks are
    among those the loss names (or among the disk copies it keeps)."""
    w = ws.worker
    for mv in s.inflight.values():
        if mv.worker == w:
            mv.status = LOST
    for mv in s.stranded.values():
        if mv.worker == w and mv.status != LOST:
            mv.status = LOST
            ws.tiers[mv.src].stranded_bytes -= mv.bytes_planned


def _move_stranded(s: State, e: ev.MoveStranded, seq: int) -> None:
    mv = _terminal(s, e.move_id, "MoveStranded", seq)
    if mv is None:
        return
    s.stranded[e.move_id] = mv
    # remember what was at risk so a late ack can re-account exactly that
    mv.bytes_planned = e.bytes_at_risk
    if mv.status == LOST:           # its worker was lost since it was requested: counted there
        return
    mv.status = "stranded"
    ws = s.workers.get(mv.worker)
    if ws is not None:
        ws.tiers[mv.src].stranded_bytes += e.bytes_at_risk


def _end_stranding(s: State, move_id: str, answer: str, seq: int) -> MoveState | None:
    """A stranded move's late answer: it is stranded no more and has this outcome. None (and an
    anomaly noted) when the move is not stranded."""
    mv = s.stranded.pop(move_id, None)
    if mv is None:
        _anomaly(s, seq, f"{answer} for move {move_id} that is not stranded")
        return None
    s.outcomes[move_id] = answer
    s.num_moves[answer] = s.num_moves.get(answer, 0) + 1
    return mv


def _move_late_acked(s: State, e: ev.MoveLateAcked, seq: int) -> None:
    mv = _end_stranding(s, e.move_id, "MoveLateAcked", seq)
    if mv is None:
        return
    ws = s.workers.get(mv.worker)
    if ws is not None:
        if mv.status == LOST:       # the incarnation that moved them is gone, and its copies with it
            return
        ws.tiers[mv.src].stranded_bytes -= mv.bytes_planned
        if ws.alive:
            _apply_arrival(s, mv, e.bytes_freed_src, e.checksum_ok, seq)


def _move_late_failed(s: State, e: ev.MoveLateFailed, seq: int) -> None:
    """A stranded move that never landed: its bytes stop being at risk; no copy moves."""
    mv = _end_stranding(s, e.move_id, "MoveLateFailed", seq)
    if mv is None:
        return
    ws = s.workers.get(mv.worker)
    if ws is not None and mv.status == "stranded":      # only a stranding that still counts its bytes
        ws.tiers[mv.src].stranded_bytes -= mv.bytes_planned


def _copies_released(s: State, e: ev.CopiesReleased, seq: int) -> None:
    """A release's answer. It settles the release as its ack would (on time, or late after a
    stranding), then frees the copies with the bytes the worker measured: the very steps, in the
    same order, that the two rows older ledgers recorded for it (an ack with nothing moved, then
    ``BlocksFreed``) take, so both forms fold to the same state. The outcome keeps the ack's name
    in ``outcomes``/``num_moves`` for that reason."""
    stranding = s.stranded.get(e.move_id)
    if stranding is not None:
        lost = stranding.status == LOST
        _move_late_acked(s, ev.MoveLateAcked(move_id=e.move_id, worker=e.worker, bytes_moved=0, bytes_freed_src=0,
                                             checksum_ok=True, started_ns=0, finished_ns=0), seq)
        if lost:                    # its copies went with the lost worker (the loss counted them)
            return
    else:
        _move_acked(s, ev.MoveAcked(move_id=e.move_id, worker=e.worker, bytes_moved=0, bytes_freed_src=0,
                                    checksum_ok=True, started_ns=0, finished_ns=0), seq)
    free_copies(s, e.worker, e.tier, e.blocks, e.bytes, seq, "CopiesReleased")


def _move_refused(s: State, e: ev.MoveRefused, seq: int) -> None:
    s.num_refusals += 1
    s.refusals.append(RefusalSummary(
        seq=seq, ask=e.ask, worker=e.worker, tier=e.tier, asked_bytes=e.asked_bytes,
        available_bytes=e.available_bytes, floor_bytes=e.floor_bytes, reason=e.reason,
    ))
    if len(s.refusals) > MAX_REFUSALS_KEPT:
        del s.refusals[0]


HANDLERS: dict[type, Callable[[State, object, int], None]] = {
    ev.MoveRequested: _move_requested,
    ev.MoveDispatched: _move_dispatched,
    ev.MoveAcked: _move_acked,
    ev.MoveFailed: _move_failed,
    ev.MoveRejected: _move_rejected,
    ev.MoveRefused: _move_refused,
    ev.MoveStranded: _move_stranded,
    ev.MoveLateAcked: _move_late_acked,
    ev.MoveAbandoned: _move_abandoned,
    ev.CopiesReleased: _copies_released,
    ev.MoveLateFailed: _move_late_failed,
}
