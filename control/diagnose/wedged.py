"""A worker up but wedged: it answered its pings while its engine made no step.

An episode starts at ``WorkerWedged`` (its onset is ``stalled_ms`` before the row: the last step
the control process saw) and ends when the worker progresses again (``WorkerResumed``, or a step
it reported), is lost or replaced (``WorkerLost``, ``WorkerJoined``), or the control process
restarts (``ServerStarted``: the new one judges the worker afresh and records a new wedge if it
still makes no step). Requests refused because of it (``RequestRefused`` "worker_wedged: ...")
are counted on the episode.
"""
from __future__ import annotations

from residency.events import (
    Recorded,
    RequestRefused,
    ServerStarted,
    StepCompleted,
    WorkerJoined,
    WorkerLost,
    WorkerResumed,
    WorkerWedged,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams

REFUSED_PREFIX = "worker_wedged:"


class WedgedWorker:
    name = "wedged_worker"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.open: dict[int, dict] = {}      # worker -> its open episode
        self.done: list[Finding] = []

    def handlers(self):
        return {
            WorkerWedged: self._wedged,
            WorkerResumed: self._resumed,
            StepCompleted: self._resumed,
            WorkerLost: self._gone,
            WorkerJoined: self._gone,
            ServerStarted: self._restarted,
            RequestRefused: self._refused,
        }

    def _wedged(self, rec: Recorded) -> None:
        e: WorkerWedged = rec.event
        if e.worker in self.open:
            return
        self.open[e.worker] = {"onset_ns": rec.envelope.ts_ns - e.stalled_ms * 1_000_000, "seq": rec.envelope.seq,
                               "event": e, "refused": 0, "seqs": [rec.envelope.seq]}

    def _refused(self, rec: Recorded) -> None:
        if not self.open or not rec.event.reason.startswith(REFUSED_PREFIX):
            return
        for ep in self.open.values():         # the reason names its worker in words; every open one counts it
            if f"worker {ep['event'].worker} " in rec.event.reason:
                ep["refused"] += 1
                if len(ep["seqs"]) < MAX_PROOF_SEQS:
                    ep["seqs"].append(rec.envelope.seq)

    def _resumed(self, rec: Recorded) -> None:
        self._end(rec.event.worker, rec, "resumed")

    def _gone(self, rec: Recorded) -> None:
        self._end(rec.event.worker, rec, "lost" if type(rec.event) is WorkerLost else "replaced")

    def _restarted(self, rec: Recorded) -> None:
        for w in list(self.open):
            self._end(w, rec, "no longer watched after the control process restarted")

    def _end(self, worker: int, rec: Recorded, how: str) -> None:
        ep = self.open.pop(worker, None) if self.open else None
        if ep is not None:
            self.done.append(self._finding(worker, ep, rec, how))

    def _finding(self, worker: int, ep: dict, end: Recorded | None, how: str | None) -> Finding:
        e: WorkerWedged = ep["event"]
        at = f"step {e.last_step}" if e.last_step is not None else "before its first step"
        title = (f"worker {worker} wedged at {at}: no step for {fmt_duration(e.stalled_ms * 1_000_000)} with "
                 f"{e.running} request(s) running (deadline {fmt_duration(e.deadline_ms * 1_000_000)}); "
                 f"{len(e.request_ids)} answered 503, {ep['refused']} refused while wedged")
        if end is not None:
            title += f"; {how} after {fmt_duration(end.envelope.ts_ns - ep['onset_ns'])}"
        return Finding(
            detector=self.name,
            severity="critical" if end is None else "warning",
            title=title,
            seqs=proof(ep["seqs"], key=[ep["seq"]] + ([end.envelope.seq] if end is not None else [])),
            subject=f"worker {worker}",
            onset_ns=ep["onset_ns"],
            until_ns=None if end is None else end.envelope.ts_ns,
            suggestion=(f"worker {worker} answers pings but its engine does not move: dump its device thread "
                        "(py-spy dump --pid <worker pid>) for the lock, driver call or loop it is in; restart "
                        "the worker if it does not resume"
                        if end is None else
                        f"look at worker {worker}'s device thread around the onset (a long move, a driver "
                        "stall, a lock); raise --wedged-after-s if its steps are legitimately that slow"),
            detail={"worker": worker, "onset_seq": ep["seq"], "last_step": e.last_step, "stalled_ms": e.stalled_ms,
                    "deadline_ms": e.deadline_ms, "requests_answered": list(e.request_ids)[:32],
                    "requests_refused": ep["refused"], "ended": how},
        )

    def finish(self, at_ns: int) -> list[Finding]:
        return self.done + [self._finding(w, ep, None, None) for w, ep in self.open.items()]
