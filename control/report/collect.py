"""What the report plots, collected during the same single pass as the diagnosis.

Series are kept as change points (``array('q')`` of ts and values: compact, appended in C) and
binned once at the end (``control.report.bins``). Audit totals follow the design's definitions:
reclaimed bytes come from acks (``bytes_freed_src``), ``BlocksFreed`` and ``CopiesReleased``, never
from plans;
stranded bytes are ``MoveStranded.bytes_at_risk`` not resolved by a late answer (``MoveLateAcked``,
``MoveLateFailed``, a late ``CopiesReleased``), plus the bytes that were only on a lost worker; a
stranding whose worker is lost later counts with the loss, once.
"""
from __future__ import annotations

from array import array

from residency.events import (
    BlocksFreed,
    BudgetSet,
    CopiesReleased,
    MoveAbandoned,
    MoveAcked,
    MoveFailed,
    MoveLateAcked,
    MoveLateFailed,
    MoveRefused,
    MoveRejected,
    MoveRequested,
    MoveStranded,
    Recorded,
    RequestAdmitted,
    RequestFinished,
    RequestRefused,
    StepCompleted,
    WorkerLost,
)
from residency.control.diagnose.accounting import Accounting

OUTCOMES = ("MoveAcked", "MoveLateAcked", "MoveFailed", "MoveRejected", "MoveStranded", "MoveAbandoned",
            "MoveLateFailed")


class Changes:
    """A step function as change points: value ``vals[i]`` holds from ``ts[i]`` on."""

    __slots__ = ("ts", "vals")

    def __init__(self) -> None:
        self.ts = array("q")
        self.vals = array("q")

    def set(self, ts: int, value: int) -> None:
        self.ts.append(ts)
        self.vals.append(value)



class Times:
    """Instants of one kind of event (binned into counts per interval)."""

    __slots__ = ("ts",)

    def __init__(self) -> None:
        self.ts = array("q")


class ReportCollector:
    def __init__(self, acct: Accounting) -> None:
        self.acct = acct
        acct.usage_listeners.append(self._usage)
        self.usage: dict[tuple[int, str], Changes] = {}       # (worker, tier) -> used bytes
        self.budgets: dict[tuple[int, str], tuple[int, int]] = {}  # (worker, tier) -> (floor, ceiling)
        self.requested: dict[str, Times] = {}                  # move kind -> instants
        self.outcomes: dict[str, Times] = {o: Times() for o in OUTCOMES}
        self.inflight = Changes()                               # moves in flight (count)
        self.inflight_bytes = Changes()
        self._inflight_bytes = 0
        self.stranded = Changes()                               # stranded bytes outstanding
        self._stranded_bytes = 0
        self.refusals: dict[str, Times] = {}                    # "move refused: device" / "request refused"
        self.waiting = Changes()                                # requests waiting
        self.steps = Times()
        self.counts: dict[str, int] = {}                        # events by type (from the pass)
        # audit totals
        self.reclaimed: dict[tuple[str, str], int] = {}         # (tier, cause) -> bytes
        self.stranded_by_why: dict[str, int] = {}               # why -> bytes outstanding
        # a byte is stranded once: a loss counts every byte of its worker, so the strandings of
        # moves requested before it stop counting (control.state.LOST, migration 0005)
        self._counted: dict[int, dict[str, tuple[str, int]]] = {}   # worker -> move -> (why, bytes)
        self._lost_seq: dict[int, int] = {}                     # worker -> seq of its last loss
        self.num_moves: dict[str, int] = {}                     # kind -> moves requested
        self.experts = None       # an ExpertLedger riding the same pass (control/report/__init__.py)
        self.bytes_moved = 0

    def handlers(self):
        return {
            BudgetSet: self._budget,
            MoveRequested: self._requested,
            MoveAcked: self._acked,
            MoveLateAcked: self._late_acked,
            MoveLateFailed: self._late_failed,
            MoveFailed: self._ended,
            MoveRejected: self._ended,
            MoveAbandoned: self._ended,
            MoveStranded: self._stranded,
            WorkerLost: self._lost,
            BlocksFreed: self._freed,
            CopiesReleased: self._released,
            MoveRefused: self._move_refused,
            RequestRefused: self._request_refused,
            RequestAdmitted: self._waiting,
            RequestFinished: self._waiting,
            StepCompleted: self._step,
        }

    # ------------------------------------------------------------ series
    def _usage(self, rec: Recorded, worker: int, tier: str, used: int) -> None:
        ch = self.usage.get((worker, tier))
        if ch is None:
            ch = self.usage[(worker, tier)] = Changes()
        ch.set(rec.envelope.ts_ns, used)

    def _budget(self, rec: Recorded) -> None:
        ev: BudgetSet = rec.event
        self.budgets[(ev.worker, ev.tier)] = (ev.floor_bytes, ev.ceiling_bytes)

    def _inflight_changed(self, ts: int, delta_bytes: int) -> None:
        self._inflight_bytes += delta_bytes
        self.inflight.set(ts, len(self.acct.inflight))
        self.inflight_bytes.set(ts, self._inflight_bytes)

    def _requested(self, rec: Recorded) -> None:
        ev: MoveRequested = rec.event
        t = self.requested.get(ev.kind)
        if t is None:
            t = self.requested[ev.kind] = Times()
        t.ts.append(rec.envelope.ts_ns)
        self.num_moves[ev.kind] = self.num_moves.get(ev.kind, 0) + 1
        self._inflight_changed(rec.envelope.ts_ns, ev.bytes_planned)

    def _ended(self, rec: Recorded, outcome: str | None = None) -> None:
        self.outcomes[outcome or rec.event.__class__.__name__].ts.append(rec.envelope.ts_ns)
        req = self.acct.ended
        if req is not None:
            self._inflight_changed(rec.envelope.ts_ns, -req.event.bytes_planned)

    def _reclaim(self, tier: str, cause: str, nbytes: int) -> None:
        if nbytes:
            self.reclaimed[(tier, cause)] = self.reclaimed.get((tier, cause), 0) + nbytes

    def _acked(self, rec: Recorded) -> None:
        self._ended(rec)
        req = self.acct.ended
        if req is not None:
            self._reclaim(req.event.src, req.event.kind, rec.event.bytes_freed_src)
        self.bytes_moved += rec.event.bytes_moved

    def _stranded_changed(self, ts: int, why: str, delta: int) -> None:
        self._stranded_bytes += delta
        self.stranded_by_why[why] = self.stranded_by_why.get(why, 0) + delta
        self.stranded.set(ts, self._stranded_bytes)

    def _stranded(self, rec: Recorded) -> None:
        self._ended(rec)
        e, req = rec.event, self.acct.ended
        requested_seq = req.envelope.seq if req is not None else rec.envelope.seq
        if self._lost_seq.get(e.worker, 0) > requested_seq:
            return
        self._counted.setdefault(e.worker, {})[e.move_id] = (e.why, e.bytes_at_risk)
        self._stranded_changed(rec.envelope.ts_ns, e.why, e.bytes_at_risk)

    def _unstranded(self, rec: Recorded) -> None:
        """A stranding resolved by its answer: its bytes stop counting, if they still did."""
        counted = self._counted.get(rec.event.worker, {}).pop(rec.event.move_id, None)
        if counted is not None:
            self._stranded_changed(rec.envelope.ts_ns, counted[0], -counted[1])

    def _late_acked(self, rec: Recorded) -> None:
        self.outcomes["MoveLateAcked"].ts.append(rec.envelope.ts_ns)
        stranding, req = self.acct.ended_stranding, self.acct.ended
        if stranding is not None:
            self._unstranded(rec)
        if req is not None:
            self._reclaim(req.event.src, req.event.kind, rec.event.bytes_freed_src)
        self.bytes_moved += rec.event.bytes_moved

    def _late_failed(self, rec: Recorded) -> None:
        self.outcomes["MoveLateFailed"].ts.append(rec.envelope.ts_ns)
        if self.acct.ended_stranding is not None:
            self._unstranded(rec)

    def _lost(self, rec: Recorded) -> None:
        self._lost_seq[rec.event.worker] = rec.envelope.seq
        for why, nbytes in self._counted.pop(rec.event.worker, {}).values():
            self._stranded_changed(rec.envelope.ts_ns, why, -nbytes)
        if rec.event.bytes_lost:
            self._stranded_changed(rec.envelope.ts_ns, "blocks_lost", rec.event.bytes_lost)

    def _freed(self, rec: Recorded) -> None:
        self._reclaim(rec.event.tier, rec.event.reason, rec.event.bytes)

    def _released(self, rec: Recorded) -> None:
        """A release answered: plotted as the ack it settles (late after a stranding), as older
        ledgers recorded it; its bytes reclaimed with the cause "release"."""
        ev: CopiesReleased = rec.event
        if self.acct.is_late():
            self.outcomes["MoveLateAcked"].ts.append(rec.envelope.ts_ns)
            self._unstranded(rec)
        else:
            self._ended(rec, "MoveAcked")
        self._reclaim(ev.tier, "release", ev.bytes)

    def _move_refused(self, rec: Recorded) -> None:
        key = f"move refused: {rec.event.tier}"
        t = self.refusals.get(key)
        if t is None:
            t = self.refusals[key] = Times()
        t.ts.append(rec.envelope.ts_ns)

    def _request_refused(self, rec: Recorded) -> None:
        t = self.refusals.get("request refused")
        if t is None:
            t = self.refusals["request refused"] = Times()
        t.ts.append(rec.envelope.ts_ns)
        self.waiting.set(rec.envelope.ts_ns, len(self.acct.waiting))

    def _waiting(self, rec: Recorded) -> None:
        self.waiting.set(rec.envelope.ts_ns, len(self.acct.waiting))

    def _step(self, rec: Recorded) -> None:
        self.steps.ts.append(rec.envelope.ts_ns)
