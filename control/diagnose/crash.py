"""A control process that died: a ``ServerStarted`` with no ``ServerStopped`` since the start before.

What the ledger shows of a crash and its recovery, all named in one finding:

    onset    the dead process's last sign of life: the latest step, checkpoint, admission, finish
             or move it recorded (``detail.onset_seq``)
    until    the ``ServerStarted`` of the process that replaced it
    adopted  workers alive at the crash that the new process kept (no WorkerJoined, no WorkerLost:
             adoption records nothing, so a later step or move of theirs is the proof)
    rejoined workers that joined afresh; lost: those recovery declared lost
    orphaned requests admitted and not finished at the crash; recovery closes each with
             ``RequestFinished(reason="control_lost")``; any left open are named

The orphaned requests are no longer waiting after the restart (``Accounting``), so they are not a stall.
"""
from __future__ import annotations

from residency.events import (
    MoveAcked,
    MoveRejected,
    Recorded,
    RequestFinished,
    RequestRefused,
    ServerStarted,
    StepCompleted,
    WorkerJoined,
    WorkerLost,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams

CLOSED_BY_RECOVERY = "control_lost"


class Crash:
    name = "crash"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.crashes: list[dict] = []
        self.current: dict | None = None       # the latest crash, while its recovery is watched

    def handlers(self):
        return {
            ServerStarted: self._started,
            WorkerJoined: self._joined,
            WorkerLost: self._lost,
            StepCompleted: self._worker_alive,
            MoveAcked: self._worker_alive,
            MoveRejected: self._worker_alive,
            RequestFinished: self._closed,
            RequestRefused: self._closed,
        }

    def _started(self, rec: Recorded) -> None:
        if not self.acct.after_crash:
            self.current = None
            return
        alive = [w for w in self.acct.workers() if w not in self.acct.lost]
        self.current = {
            "start": rec, "onset_ns": self.acct.before_start_ns or rec.envelope.ts_ns,
            "onset_seq": self.acct.before_start_seq or rec.envelope.seq,
            "orphans": {rid: r.envelope.seq for rid, r in self.acct.orphaned.items()},
            "closed": {}, "closed_other": {}, "alive": alive, "adopted": {}, "rejoined": {}, "lost": {},
        }
        self.crashes.append(self.current)

    def _joined(self, rec: Recorded) -> None:
        c = self.current
        if c is not None and rec.event.worker in c["alive"] and rec.event.worker not in c["lost"]:
            c["rejoined"].setdefault(rec.event.worker, rec.envelope.seq)

    def _lost(self, rec: Recorded) -> None:
        c = self.current
        if c is not None and rec.event.worker in c["alive"]:
            c["lost"].setdefault(rec.event.worker, rec.envelope.seq)

    def _worker_alive(self, rec: Recorded) -> None:
        c = self.current
        w = rec.event.worker
        if c is not None and w in c["alive"] and w not in c["rejoined"] and w not in c["lost"]:
            c["adopted"].setdefault(w, rec.envelope.seq)

    def _closed(self, rec: Recorded) -> None:
        c = self.current
        rid = rec.event.request_id
        if c is None or rid not in c["orphans"]:
            return
        by_recovery = type(rec.event) is RequestFinished and rec.event.reason == CLOSED_BY_RECOVERY
        (c["closed"] if by_recovery else c["closed_other"])[rid] = rec.envelope.seq

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for c in self.crashes:
            start: Recorded = c["start"]
            orphans = c["orphans"]
            still = sorted(set(orphans) - set(c["closed"]) - set(c["closed_other"]))
            silent = [w for w in c["alive"] if w not in c["adopted"] and w not in c["rejoined"] and w not in c["lost"]]

            def ws(d) -> str:
                return ", ".join(str(w) for w in sorted(d)) or "none"

            parts = [f"workers adopted: {ws(c['adopted'])}", f"rejoined: {ws(c['rejoined'])}", f"lost: {ws(c['lost'])}"]
            if silent:
                parts.append(f"not heard from since: {ws(silent)}")
            orphan_words = (f"{len(orphans)} request(s) orphaned, {len(c['closed'])} closed by recovery "
                            f"(reason {CLOSED_BY_RECOVERY!r})")
            if c["closed_other"]:
                orphan_words += f", {len(c['closed_other'])} closed otherwise"
            if still:
                orphan_words += f", {len(still)} never closed ({', '.join(still[:3])})"
            down_ns = start.envelope.ts_ns - c["onset_ns"]
            key = [c["onset_seq"], start.envelope.seq] + [orphans[r] for r in still[:4]]
            seqs = ([*orphans.values()][:MAX_PROOF_SEQS // 2] + [*c["closed"].values()][:MAX_PROOF_SEQS // 4]
                    + [*c["adopted"].values(), *c["rejoined"].values(), *c["lost"].values()])
            out.append(Finding(
                detector=self.name,
                severity="critical" if still else "warning",
                title=(f"the control process died without a stop (down {fmt_duration(down_ns)}, restarted at seq "
                       f"{start.envelope.seq}); {'; '.join(parts)}; {orphan_words}"),
                seqs=proof(seqs, key=key),
                subject="control process",
                onset_ns=c["onset_ns"],
                until_ns=start.envelope.ts_ns,
                suggestion=("recovery closed what the crash left: look in the control process's log (and the OS's, "
                            "for an OOM kill) for why it died" if not still else
                            "the restarted process did not close the requests the crash orphaned: they are not "
                            "running; upgrade to a recovery that closes them (RequestFinished control_lost)"),
                detail={"onset_seq": c["onset_seq"], "restart_seq": start.envelope.seq, "down_ns": down_ns,
                        "adopted": sorted(c["adopted"]), "rejoined": sorted(c["rejoined"]),
                        "lost": sorted(c["lost"]), "silent": silent, "num_orphaned": len(orphans),
                        "num_closed_by_recovery": len(c["closed"]), "never_closed": still[:32]},
            ))
        return out
