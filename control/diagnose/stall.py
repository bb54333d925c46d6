"""Detectors of requests waiting while the server does nothing useful.

A stall is seen from the ledger alone: requests admitted and not finished, and for
``stall_after_ns`` no forward step and no acked move. Heartbeats, refusals and strandings keep
arriving during a stall (every process is alive), so they are not progress; only
``StepCompleted``, ``MoveAcked`` and ``MoveLateAcked`` are.

A stall ends where the server does: at a ``ServerStopped``, or at the last sign of life before a
``ServerStarted`` that no stop preceded (a crash: the ``crash`` detector names it and the requests
it orphaned; they are not counted as waiting afterwards).

A hole is narrower: device bytes were freed while requests waited, and nothing was allocated on
that device for ``hole_after_ns`` afterwards: the memory the queue needed sat there unused.
"""
from __future__ import annotations

from residency.events import (
    BlocksCommitted,
    BlocksFreed,
    CopiesReleased,
    MoveAcked,
    MoveLateAcked,
    Recorded,
    RequestAdmitted,
    RequestFinished,
    RequestRefused,
    ServerStarted,
    ServerStopped,
    StepCompleted,
    WorkerLost,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


class Stall:
    name = "stall"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.after = params.stall_after_ns
        self.onset_ns: int | None = None    # since when requests wait with no progress
        self.onset_seq = 0
        self.last_progress: Recorded | None = None
        self.ep_seqs: list[int] = []         # admissions during the episode
        self.ep_oldest: int | None = None    # the oldest request waiting when it began
        self.ep_requests = 0
        self.done: list[Finding] = []

    def handlers(self):
        return {
            StepCompleted: self._progress,
            MoveAcked: self._progress,
            MoveLateAcked: self._progress,
            CopiesReleased: self._progress,
            RequestAdmitted: self._admitted,
            RequestFinished: self._left,
            RequestRefused: self._left,
            ServerStarted: self._server_edge,
            ServerStopped: self._server_edge,
        }

    def _server_edge(self, rec: Recorded) -> None:
        """Nothing progresses while no server runs: an open episode ends at the stop, or, after a
        crash, at the last event the dead process wrote (the downtime is the crash's, not a stall)."""
        if self.onset_ns is None:
            return
        end_ns = rec.envelope.ts_ns
        if type(rec.event) is ServerStarted and self.acct.before_start_ns is not None:
            end_ns = max(self.onset_ns, self.acct.before_start_ns)
        f = self._close(rec, end_ns, num_still=0)
        if f is not None:
            self.done.append(f)
        self.onset_ns = None

    def _open(self, rec: Recorded) -> None:
        # O(1): this runs at every step; the proof is gathered only if the episode becomes a finding
        self.onset_ns, self.onset_seq = rec.envelope.ts_ns, rec.envelope.seq
        waiting = self.acct.waiting
        self.ep_requests = len(waiting)
        self.ep_oldest = next(iter(waiting.values())).envelope.seq if waiting else None
        self.ep_seqs = []

    def _close(self, rec: Recorded | None, at_ns: int, num_still: int = MAX_PROOF_SEQS) -> Finding | None:
        onset = self.onset_ns
        if onset is None or at_ns - onset < self.after:
            return None
        end_seq = rec.envelope.seq if rec is not None else None
        still = [r.envelope.seq for _, r in zip(range(num_still), self.acct.waiting.values())]
        key = [s for s in (self.ep_oldest, rec.envelope.seq if rec is not None else None,
                           self.last_progress.envelope.seq if self.last_progress is not None else None)
               if s is not None]
        ongoing = rec is None
        meanwhile = ""
        if end_seq is not None:
            meanwhile = f" ({end_seq - self.onset_seq - 1} other events recorded meanwhile)"
        last = (f"last progress at seq {self.last_progress.envelope.seq}"
                if self.last_progress is not None else "no progress recorded before it")
        return Finding(
            detector=self.name,
            severity="critical" if ongoing else "warning",
            title=(f"{self.ep_requests} request(s) waiting {fmt_duration(at_ns - onset)} with no forward step "
                   f"and no acked move{meanwhile}; {last}"),
            seqs=proof(self.ep_seqs + still, key=key),
            subject="requests",
            onset_ns=onset,
            until_ns=None if ongoing else at_ns,
            suggestion=("the queue is not draining though processes answer: look at the moves in flight "
                        "and the scheduler's last decision; a green /health does not mean progress"),
            detail={"num_requests": self.ep_requests,
                    "last_progress_seq": self.last_progress.envelope.seq if self.last_progress else None},
        )

    def _progress(self, rec: Recorded) -> None:
        f = self._close(rec, rec.envelope.ts_ns)
        if f is not None:
            self.done.append(f)
        self.last_progress = rec
        if self.acct.waiting:
            self._open(rec)
        else:
            self.onset_ns = None

    def _admitted(self, rec: Recorded) -> None:
        if self.onset_ns is None:
            self._open(rec)
        else:
            self.ep_requests += 1
            if len(self.ep_seqs) < MAX_PROOF_SEQS:
                self.ep_seqs.append(rec.envelope.seq)

    def _left(self, rec: Recorded) -> None:
        if not self.acct.waiting and self.onset_ns is not None:
            f = self._close(rec, rec.envelope.ts_ns)
            if f is not None:
                self.done.append(f)
            self.onset_ns = None

    def finish(self, at_ns: int) -> list[Finding]:
        out = list(self.done)
        if self.acct.waiting:
            f = self._close(None, at_ns)
            if f is not None:
                out.append(f)
        return out


class Hole:
    name = "hole"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.after = params.hole_after_ns
        self.holes: dict[int, dict] = {}     # worker -> open hole
        self.done: list[Finding] = []

    def handlers(self):
        return {
            BlocksFreed: self._blocks_freed,
            BlocksCommitted: self._blocks_committed,
            MoveAcked: self._move_acked,
            MoveLateAcked: self._move_acked,
            CopiesReleased: self._released,
            RequestFinished: self._left,
            RequestRefused: self._left,
            ServerStarted: self._left,       # the queue died with the process (Accounting)
            ServerStopped: self._left,
            WorkerLost: self._lost,
        }

    def _freed(self, rec: Recorded, worker: int, freed_bytes: int) -> None:
        if not self.acct.waiting or freed_bytes <= 0:
            return
        hole = self.holes.get(worker)
        if hole is None:
            hole = self.holes[worker] = {"onset_ns": rec.envelope.ts_ns, "bytes": 0, "seqs": [],
                                         "waiting": [r.envelope.seq for _, r in zip(range(8), self.acct.waiting.values())],
                                         "num_waiting": len(self.acct.waiting)}
        hole["bytes"] += freed_bytes
        if len(hole["seqs"]) < MAX_PROOF_SEQS:
            hole["seqs"].append(rec.envelope.seq)

    def _claimed(self, rec: Recorded, worker: int) -> None:
        hole = self.holes.pop(worker, None)
        if hole is not None:
            self._keep(self._emit(worker, hole, rec, rec.envelope.ts_ns))

    def _keep(self, f: Finding | None) -> None:
        if f is not None:
            self.done.append(f)

    def _emit(self, worker: int, hole: dict, rec: Recorded | None, at_ns: int) -> Finding | None:
        if at_ns - hole["onset_ns"] < self.after:
            return None
        seqs = proof(hole["seqs"] + hole["waiting"], key=[hole["seqs"][0]] + ([rec.envelope.seq] if rec else []))
        return Finding(
            detector=self.name,
            severity="warning",
            title=(f"{fmt_bytes(hole['bytes'])} freed on worker {worker}'s device sat unclaimed "
                   f"{fmt_duration(at_ns - hole['onset_ns'])} while {hole['num_waiting']} request(s) waited"),
            seqs=proof(seqs),
            subject=f"worker {worker}",
            onset_ns=hole["onset_ns"],
            until_ns=None if rec is None else at_ns,
            suggestion="the scheduler did not admit waiting work into freed pages: check its admission budget against the device floor",
            detail={"worker": worker, "freed_bytes": hole["bytes"], "num_waiting": hole["num_waiting"]},
        )

    def _blocks_freed(self, rec: Recorded) -> None:
        ev: BlocksFreed = rec.event
        if ev.tier == "device":
            self._freed(rec, ev.worker, ev.bytes)

    def _blocks_committed(self, rec: Recorded) -> None:
        ev: BlocksCommitted = rec.event
        if ev.tier == "device":
            self._claimed(rec, ev.worker)

    def _move_acked(self, rec: Recorded) -> None:
        req_rec = self.acct.ended
        if req_rec is None:
            return
        req = req_rec.event
        if req.dst == "device":
            self._claimed(rec, req.worker)
        elif req.src == "device" and not req.keep_source:
            self._freed(rec, req.worker, rec.event.bytes_freed_src)

    def _released(self, rec: Recorded) -> None:
        ev: CopiesReleased = rec.event           # settled as an ack, then its copies freed
        self._move_acked(rec)
        if ev.tier == "device":
            self._freed(rec, ev.worker, ev.bytes)

    def _left(self, rec: Recorded) -> None:
        if not self.acct.waiting:
            for worker, hole in self.holes.items():
                self._keep(self._emit(worker, hole, rec, rec.envelope.ts_ns))
            self.holes.clear()

    def _lost(self, rec: Recorded) -> None:
        self.holes.pop(rec.event.worker, None)

    def finish(self, at_ns: int) -> list[Finding]:
        ongoing = [self._emit(worker, hole, None, at_ns) for worker, hole in self.holes.items()]
        return self.done + [f for f in ongoing if f is not None]
