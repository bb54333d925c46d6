"""A worker silent or lost, with the bytes stranded on it.

Silence starts at ``WorkerHeartbeatMissed`` (its onset is ``silent_ms`` before the row) and ends
at the worker's next sign of life: a step, an ack, a failure or a rejection it reported, or a
rejoin. Loss is ``WorkerLost``; the bytes stranded by it are the ones it names (blocks whose
only copy was there) plus the ``MoveStranded(why="worker_lost")`` that follow, less any late ack.
A move on a lost worker left with no outcome at all is named too: the ledger's invariant says
every move gets exactly one.
"""
from __future__ import annotations

from residency.events import (
    CopiesReleased,
    MoveAbandoned,
    MoveAcked,
    MoveFailed,
    MoveLateAcked,
    MoveLateFailed,
    MoveRejected,
    MoveStranded,
    Recorded,
    StepCompleted,
    WorkerHeartbeatMissed,
    WorkerJoined,
    WorkerLost,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


class WorkerSilence:
    name = "worker"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.silent_after = params.silent_after_ns
        self.silent: dict[int, dict] = {}    # worker -> open silence
        self.lost: dict[int, dict] = {}      # worker -> open loss
        self.done: list[Finding] = []

    def handlers(self):
        return {
            WorkerHeartbeatMissed: self._missed,
            StepCompleted: self._alive,
            MoveAcked: self._alive,
            MoveFailed: self._alive,
            MoveRejected: self._alive,
            MoveLateAcked: self._late_acked,
            MoveLateFailed: self._late_acked,    # its stranding closed: nothing at risk
            CopiesReleased: self._late_acked,     # a release answered (on time: the same as alive)
            WorkerJoined: self._joined,
            WorkerLost: self._lost,
            MoveStranded: self._stranded,
            MoveAbandoned: self._abandoned,
        }

    # ------------------------------------------------------------ silence
    def _missed(self, rec: Recorded) -> None:
        ev: WorkerHeartbeatMissed = rec.event
        if ev.worker in self.lost:
            return
        s = self.silent.get(ev.worker)
        if s is None:
            s = self.silent[ev.worker] = {"onset_ns": rec.envelope.ts_ns - ev.silent_ms * 1_000_000, "seqs": []}
        s["silent_ms"] = ev.silent_ms
        if len(s["seqs"]) < MAX_PROOF_SEQS:
            s["seqs"].append(rec.envelope.seq)

    def _silence_finding(self, worker: int, s: dict, rec: Recorded | None, at_ns: int) -> Finding:
        ongoing = rec is None
        inflight = [r for r in self.acct.inflight.values() if r.event.worker == worker]
        at_risk = sum(r.event.bytes_planned for r in inflight)
        # a worker frozen mid-move has its move stranded at the deadline, not in flight: name those too
        stranded = [hit for hit in self.acct.stranded.values() if hit[0].event.worker == worker] if ongoing else []
        stranded_bytes = sum(st.event.bytes_at_risk for st, _ in stranded)
        resident = sum(self.acct.used_bytes(worker, tier) for (w, tier) in self.acct.copies if w == worker)
        if ongoing:
            named = ", ".join(st.event.move_id for st, _ in stranded[:4]) + (", ..." if len(stranded) > 4 else "")
            also = f", {len(stranded)} stranded there ({fmt_bytes(stranded_bytes)}: {named})" if stranded else ""
            title = (f"worker {worker} silent for {fmt_duration(at_ns - s['onset_ns'])}: {len(inflight)} move(s) "
                     f"in flight on it ({fmt_bytes(at_risk)}){also}, {fmt_bytes(resident)} resident there")
            suggestion = (f"check worker {worker}'s process and its link; if it is gone, record it lost so its "
                          f"moves are stranded with their bytes named")
        else:
            title = f"worker {worker} was silent for {fmt_duration(at_ns - s['onset_ns'])}, then answered"
            suggestion = f"look at worker {worker}'s logs around the silence (GC pause, driver stall, host swap)"
        return Finding(
            detector=self.name,
            severity="warning" if ongoing else "info",
            title=title,
            seqs=proof(s["seqs"] + [r.envelope.seq for r in inflight] + [st.envelope.seq for st, _ in stranded],
                       key=[rec.envelope.seq] if rec else []),
            subject=f"worker {worker}",
            onset_ns=s["onset_ns"],
            until_ns=None if ongoing else at_ns,
            suggestion=suggestion,
            detail={"worker": worker, "silent_ms": s["silent_ms"], "bytes_in_flight": at_risk if ongoing else None,
                    "bytes_resident": resident if ongoing else None,
                    "bytes_stranded": stranded_bytes if ongoing else None,
                    "stranded_moves": [st.event.move_id for st, _ in stranded][:32]},
        )

    def _alive(self, rec: Recorded) -> None:
        s = self.silent.pop(rec.event.worker, None) if self.silent else None
        if s is not None:
            self.done.append(self._silence_finding(rec.event.worker, s, rec, rec.envelope.ts_ns))

    # ------------------------------------------------------------ loss
    def _lost(self, rec: Recorded) -> None:
        ev: WorkerLost = rec.event
        s = self.silent.pop(ev.worker, None)
        self.lost[ev.worker] = {
            "onset_ns": rec.envelope.ts_ns, "seqs": [rec.envelope.seq] + (s["seqs"][:8] if s else []),
            "event": ev, "stranded": {}, "abandoned": {},
            "resident": self.acct.resident_at_loss.get(ev.worker, 0),
        }

    def _stranded(self, rec: Recorded) -> None:
        loss = self.lost.get(rec.event.worker)
        if loss is not None and rec.event.why == "worker_lost":
            loss["stranded"][rec.event.move_id] = rec.event.bytes_at_risk
            if len(loss["seqs"]) < MAX_PROOF_SEQS:
                loss["seqs"].append(rec.envelope.seq)

    def _abandoned(self, rec: Recorded) -> None:
        loss = self.lost.get(rec.event.worker)
        req = self.acct.ended
        if loss is not None and req is not None:
            loss["abandoned"][rec.event.move_id] = req.event.bytes_planned
            if len(loss["seqs"]) < MAX_PROOF_SEQS:
                loss["seqs"].append(rec.envelope.seq)

    def _late_acked(self, rec: Recorded) -> None:
        loss = self.lost.get(rec.event.worker)
        if loss is not None:
            loss["stranded"].pop(rec.event.move_id, None)
        self._alive(rec)

    def _joined(self, rec: Recorded) -> None:
        w = rec.event.worker
        loss = self.lost.pop(w, None)
        if loss is not None:
            self.done.append(self._loss_finding(w, loss, rec.envelope.ts_ns, rejoined=rec))
        self._alive(rec)

    def _loss_finding(self, worker: int, loss: dict, at_ns: int, rejoined: Recorded | None) -> Finding:
        ev: WorkerLost = loss["event"]
        stranded = sum(loss["stranded"].values())
        abandoned = sum(loss["abandoned"].values())
        # moves on it that never got an outcome: only meaningful while it is still lost
        orphans = [] if rejoined else [r for r in self.acct.inflight.values() if r.event.worker == worker]
        total = ev.bytes_lost + stranded
        parts = [f"{fmt_bytes(ev.bytes_lost)} whose only copy was there"]
        if loss["stranded"]:
            parts.append(f"{len(loss['stranded'])} move(s) in flight stranded ({fmt_bytes(stranded)})")
        if loss["abandoned"]:
            parts.append(f"{len(loss['abandoned'])} abandoned ({fmt_bytes(abandoned)} planned)")
        if orphans:
            parts.append(f"{len(orphans)} move(s) with no outcome recorded")
        if ev.bytes_kept:
            parts.append(f"{fmt_bytes(ev.bytes_kept)} on its disk kept by the next incarnation")
        if loss["resident"] != ev.bytes_lost:
            parts.append(f"but the ledger had {fmt_bytes(loss['resident'])} of blocks there")
        tail = f", rejoined after {fmt_duration(at_ns - loss['onset_ns'])}" if rejoined else ""
        return Finding(
            detector=self.name,
            severity="critical" if (total or orphans) and not rejoined else
                     "warning" if total or orphans or not ev.bytes_kept else "info",
            title=f"worker {worker} lost ({ev.reason}): {fmt_bytes(total)} stranded: {'; '.join(parts)}{tail}",
            seqs=proof(loss["seqs"] + [r.envelope.seq for r in orphans],
                       key=[loss["seqs"][0]] + ([rejoined.envelope.seq] if rejoined else [])),
            subject=f"worker {worker}",
            onset_ns=loss["onset_ns"],
            until_ns=at_ns if rejoined else None,
            suggestion=("nothing was lost: its disk copies were kept"
                        if rejoined and ev.bytes_kept and not (total or orphans) else
                        "sessions whose blocks were there must recompute; "
                        + ("strand or abandon the moves with no outcome so their bytes are named"
                           if orphans else "replace the worker or shrink the group")),
            detail={"worker": worker, "bytes_lost": ev.bytes_lost, "bytes_kept_on_disk": ev.bytes_kept,
                    "bytes_stranded": stranded,
                    "bytes_abandoned": abandoned, "bytes_resident_at_loss": loss["resident"],
                    "moves_without_outcome": [r.event.move_id for r in orphans][:32]},
        )

    def finish(self, at_ns: int) -> list[Finding]:
        out = list(self.done)
        for worker, s in self.silent.items():
            if at_ns - s["onset_ns"] >= self.silent_after:
                out.append(self._silence_finding(worker, s, None, at_ns))
        for worker, loss in self.lost.items():
            out.append(self._loss_finding(worker, loss, at_ns, rejoined=None))
        return out
