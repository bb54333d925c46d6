"""When each block was last used and last moved, and when each session was last active.

The fold does not keep this (it is soft: a policy's hint, not an account), but it is implied by
the ledger: ``observe`` is called with every event, in ledger order, *before* that event is folded
(so an ack can find its move in ``state.inflight``). Recovery rebuilds it the same way, so policies
decide the same after a restart. Times are the envelopes' ``ts_ns``; nothing reads a clock.

Unknown means hot: a block whose use time is not known is never chosen by a policy
(refusing to reclaim is the safe direction).
"""
from __future__ import annotations

from events import catalog as ev
from control.state import State


class Recency:
    def __init__(self) -> None:
        self.block_used: dict[tuple[int, int], int] = {}
        self.block_moved: dict[tuple[int, int], int] = {}
        self.session_active: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    def is_hot(self, worker: int, block: int, now_ns: int, hot_ns: int) -> bool:
        used = self.block_used.get((worker, block))
        return used is None or now_ns - used < hot_ns

    def is_cooling(self, worker: int, block: int, now_ns: int, cooldown_ns: int) -> bool:
        """Moved within the cooldown: a policy leaves it where it is, so the same blocks are not
        spilled and restored back and forth (a demand restore is never held back by this)."""
        moved = self.block_moved.get((worker, block))
        return moved is not None and now_ns - moved < cooldown_ns

    def idle_ns(self, session: str, now_ns: int) -> int | None:
        active = self.session_active.get(session)
        return None if active is None else now_ns - active

    def last_used(self, worker: int, block: int) -> int:
        return self.block_used.get((worker, block), 1 << 62)

    # ------------------------------------------------------------------ updates
    def observe(self, state: State, event, ts_ns: int) -> None:
        """Note what ``event`` says about use and movement. Call before folding it."""
        t = type(event)
        if t is ev.BlocksCommitted:
            w = event.worker
            for b in event.blocks:
                self.block_used[(w, b)] = ts_ns
            if event.session is not None:
                self.session_active[event.session] = ts_ns
        elif t is ev.MoveAcked or t is ev.MoveLateAcked:
            mv = (state.inflight if t is ev.MoveAcked else state.stranded).get(event.move_id)
            if mv is None:
                return
            w = mv.worker
            for b in mv.blocks:
                self.block_moved[(w, b)] = ts_ns
                if mv.dst == "device" and mv.src != "device":
                    self.block_used[(w, b)] = ts_ns     # restored because someone needs it
            if mv.dst == "device" and mv.session is not None:
                self.session_active[mv.session] = ts_ns
        elif t is ev.RequestAdmitted:
            if event.session is not None:
                self.session_active[event.session] = ts_ns
        elif t is ev.SessionRestored:
            self.session_active[event.session] = ts_ns
        elif t is ev.WorkerLost:
            w = event.worker
            for d in (self.block_used, self.block_moved):
                for key in [k for k in d if k[0] == w]:
                    del d[key]

    def prune(self, state: State) -> None:
        """Forget blocks the state no longer has (called now and then, e.g. at checkpoints)."""
        for d in (self.block_used, self.block_moved):
            for key in [k for k in d if k[1] not in state.blocks.get(k[0], ())]:
                del d[key]
