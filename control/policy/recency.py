"""When each block was last used and last moved, and when each session was last active.

The fold does not keep this (it is soft: a policy's hint, not an account), but it is implied by
the ledger: ``observe`` is called with every event, in ledger order, *before* that event is folded
(so an ack can find its move in ``state.inflight``). Recovery rebuilds it the same way, so policies
decide the same after a restart. Times are the envelopes' ``ts_ns``; nothing reads a clock.

Unknown means hot: a block whose use time is not known is never chosen by a policy
(refusing to reclaim is the safe direction).
"""
from __future__ import annotations

from residency.events import catalog as ev
from residency.control.state import State


class Recency:
    """Per worker, block -> time (``used``, ``moved``); per session, time of last activity.

    NOTE: kept per worker (dicts of block -> ns, not one dict of (worker, block) keys) so an ack of a
    big move updates its blocks in one C-level ``dict.update(dict.fromkeys(blocks, ts))``: no tuple
    and no Python step per block on the control loop between an ack and its commit.
    """

    def __init__(self) -> None:
        self.used: dict[int, dict[int, int]] = {}
        self.moved: dict[int, dict[int, int]] = {}
        self.session_active: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    def is_hot(self, worker: int, block: int, now_ns: int, hot_ns: int) -> bool:
        used = self.used.get(worker, _NONE).get(block)
        return used is None or now_ns - used < hot_ns

    def is_cooling(self, worker: int, block: int, now_ns: int, cooldown_ns: int) -> bool:
        """Moved within the cooldown: a policy leaves it where it is, so the same blocks are not
        spilled and restored back and forth (a demand restore is never held back by this)."""
        moved = self.moved.get(worker, _NONE).get(block)
        return moved is not None and now_ns - moved < cooldown_ns

    def idle_ns(self, session: str, now_ns: int) -> int | None:
        active = self.session_active.get(session)
        return None if active is None else now_ns - active

    def last_used(self, worker: int, block: int) -> int:
        return self.used.get(worker, _NONE).get(block, 1 << 62)

    # ------------------------------------------------------------------ updates
    def observe(self, state: State, event, ts_ns: int) -> None:
        """Note what ``event`` says about use and movement. Call before folding it."""
        t = type(event)
        if t is ev.BlocksCommitted:
            _stamp(self.used, event.worker, event.blocks, ts_ns)
            if event.session is not None:
                self.session_active[event.session] = ts_ns
        elif t is ev.MoveAcked or t is ev.MoveLateAcked or t is ev.CopiesReleased:
            mv = (state.stranded if t is ev.MoveLateAcked else state.inflight).get(event.move_id)
            if mv is None and t is ev.CopiesReleased:       # a release answered after its stranding
                mv = state.stranded.get(event.move_id)
            if mv is None:
                return
            _stamp(self.moved, mv.worker, mv.blocks, ts_ns)
            if mv.dst == "device":
                if mv.src != "device":
                    _stamp(self.used, mv.worker, mv.blocks, ts_ns)     # restored because someone needs it
                if mv.session is not None:
                    self.session_active[mv.session] = ts_ns
        elif t is ev.RequestAdmitted:
            if event.session is not None:
                self.session_active[event.session] = ts_ns
        elif t is ev.SessionRestored:
            self.session_active[event.session] = ts_ns
        elif t is ev.WorkerLost:
            self.used.pop(event.worker, None)
            self.moved.pop(event.worker, None)

    def prune(self, state: State) -> None:
        """Forget blocks the state no longer has (called now and then, e.g. at checkpoints)."""
        for by_worker in (self.used, self.moved):
            for w, times in list(by_worker.items()):
                gone = times.keys() - state.blocks.get(w, _NONE).keys()
                for b in gone:
                    del times[b]
                if not times:
                    del by_worker[w]


_NONE: dict = {}


def _stamp(by_worker: dict[int, dict[int, int]], worker: int, blocks, ts_ns: int) -> None:
    times = by_worker.get(worker)
    if times is None:
        by_worker[worker] = dict.fromkeys(blocks, ts_ns)
    else:
        times.update(dict.fromkeys(blocks, ts_ns))
