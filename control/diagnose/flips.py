"""Flips of a weights arena that went wrong: a pendulum, and a flip that never completed.

    flip_pendulum   one worker's arena swung between models again and again (A->B->A...) within
                    a window, serving little between the swings: each swing pays the link both
                    ways and serves nobody meanwhile (the flip policy's minimum residency or its
                    cost-against-backlog rule is too weak for the load, or an operator loops)
    flip_stuck      a flip requested and never answered past its deadline (plus a grace), or one
                    recorded stranded and never repaired by a later complete flip or wake: the
                    worker's arena holds an image nobody verified, and its model serves nothing

A new incarnation of the worker (``WeightsLoaded``) loads its own image: what the old one left
stuck is gone with it.
"""
from __future__ import annotations

from residency.events import FlipCompleted, FlipFailed, FlipRequested, Recorded, RequestAdmitted, WeightsLoaded
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import Finding, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


class FlipPendulum:
    name = "flip_pendulum"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.min_flips = params.flip_pendulum_flips
        self.window = params.flip_pendulum_window_ns
        self.min_served = params.flip_pendulum_min_served
        self.requested: dict[str, Recorded] = {}
        self.swings: dict[int, list[dict]] = {}     # worker -> the current run of swings
        self.served: dict[int, int] = {}            # worker -> requests admitted since its last flip
        self.episodes: list[dict] = []

    def handlers(self):
        return {FlipRequested: self._requested, FlipCompleted: self._completed, RequestAdmitted: self._admitted,
                WeightsLoaded: self._loaded}

    def _requested(self, rec: Recorded) -> None:
        if rec.event.action == "flip":
            self.requested[rec.event.flip_id] = rec

    def _admitted(self, rec: Recorded) -> None:
        w = rec.event.worker
        if w is not None:
            self.served[w] = self.served.get(w, 0) + 1

    def _loaded(self, rec: Recorded) -> None:
        self._close(rec.event.worker)

    def _completed(self, rec: Recorded) -> None:
        req = self.requested.pop(rec.event.flip_id, None)
        if req is None:
            return
        w = req.event.worker
        served = self.served.get(w, 0)
        self.served[w] = 0
        run = self.swings.setdefault(w, [])
        swing = {"from": req.event.from_model, "to": req.event.to_model, "req": req, "done": rec, "served": served}
        # the run goes on while each swing goes back to where the one before came from, within
        # the window, with little served between them
        if run and not (swing["to"] == run[-1]["from"] and served < self.min_served
                        and rec.envelope.ts_ns - run[0]["done"].envelope.ts_ns <= self.window):
            self._close(w)
            run = self.swings.setdefault(w, [])
        run.append(swing)

    def _close(self, w: int) -> None:
        run = self.swings.pop(w, [])
        if len(run) >= self.min_flips:
            self.episodes.append({"worker": w, "run": run})

    def finish(self, at_ns: int) -> list[Finding]:
        for w in list(self.swings):
            self._close(w)
        out = []
        for ep in self.episodes:
            run = ep["run"]
            models = []
            for s in run:
                for m in (s["from"], s["to"]):
                    if m not in models:
                        models.append(m)
            first, last = run[0]["req"].envelope.ts_ns, run[-1]["done"].envelope.ts_ns
            served = sum(s["served"] for s in run[1:])
            path = " -> ".join([run[0]["from"]] + [s["to"] for s in run])
            moved = sum(s["done"].event.bytes_in + s["done"].event.bytes_out for s in run)
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"worker {ep['worker']}'s weights swung {len(run)} times in {fmt_duration(last - first)} "
                       f"({path}), {served} request(s) admitted between the swings, {moved} bytes moved"),
                seqs=proof([x.envelope.seq for s in run for x in (s["req"], s["done"])]),
                subject=f"weights arena on worker {ep['worker']}",
                onset_ns=first,
                until_ns=last,
                suggestion=("two models wanted at once on one arena: raise the flip policy's minimum residency, "
                            "serve each model from its own worker, or batch each model's requests"),
                detail={"worker": ep["worker"], "num_flips": len(run), "models": models, "served_between": served,
                        "bytes_moved": moved, "flip_ids": [s["req"].event.flip_id for s in run]},
            ))
        return out


class FlipStuck:
    name = "flip_stuck"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.grace = params.flip_grace_ns
        self.timeout = params.flip_timeout_ns
        self.pending: dict[str, Recorded] = {}
        self.stranded: dict[int, dict] = {}          # worker -> {"req", "failed"} not repaired yet

    def handlers(self):
        return {FlipRequested: self._requested, FlipCompleted: self._completed, FlipFailed: self._failed,
                WeightsLoaded: self._loaded}

    def _requested(self, rec: Recorded) -> None:
        self.pending[rec.event.flip_id] = rec

    def _completed(self, rec: Recorded) -> None:
        req = self.pending.pop(rec.event.flip_id, None)
        if req is not None:
            self.stranded.pop(req.event.worker, None)    # a complete flip or wake repairs the arena

    def _failed(self, rec: Recorded) -> None:
        req = self.pending.pop(rec.event.flip_id, None)
        if req is not None and rec.event.stranded:
            self.stranded[req.event.worker] = {"req": req, "failed": rec}

    def _loaded(self, rec: Recorded) -> None:
        w = rec.event.worker
        self.stranded.pop(w, None)
        for fid in [f for f, r in self.pending.items() if r.event.worker == w]:
            del self.pending[fid]

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for req in self.pending.values():
            e: FlipRequested = req.event
            due = (e.deadline_ns + self.grace) if e.deadline_ns else req.envelope.ts_ns + self.timeout
            if at_ns <= due:
                continue
            out.append(Finding(
                detector=self.name,
                severity="critical",
                title=(f"{e.action} {e.flip_id} on worker {e.worker} ({e.from_model or '-'} -> {e.to_model or '-'}) "
                       f"requested {fmt_duration(at_ns - req.envelope.ts_ns)} ago and never answered"),
                seqs=proof([req.envelope.seq], [req.envelope.seq]),
                subject=f"weights arena on worker {e.worker}",
                onset_ns=req.envelope.ts_ns,
                until_ns=None,
                suggestion="the worker never answered SwapWeights: check it is alive; the watchdog should have "
                           "stranded the flip at its deadline (is the control loop running?)",
                detail={"flip_id": e.flip_id, "worker": e.worker, "action": e.action,
                        "bytes_at_stake": max(e.bytes_in, e.bytes_out)},
            ))
        for w, st in self.stranded.items():
            req, failed = st["req"], st["failed"]
            e, f = req.event, failed.event
            nbytes = "unknown" if f.stranded_bytes is None else f"{f.stranded_bytes} bytes"
            out.append(Finding(
                detector=self.name,
                severity="critical",
                title=(f"{e.action} {e.flip_id} on worker {w} stranded ({nbytes} of the arena unknown) and never "
                       f"repaired: {f.error}"),
                seqs=proof([req.envelope.seq, failed.envelope.seq], [req.envelope.seq, failed.envelope.seq]),
                subject=f"weights arena on worker {w}",
                onset_ns=failed.envelope.ts_ns,
                until_ns=None,
                suggestion=f"a complete flip or wake repairs it: `residency ctl flip --to MODEL --worker {w}` "
                           f"(or POST /wake_up after a sleep)",
                detail={"flip_id": e.flip_id, "worker": w, "action": e.action, "stranded_bytes": f.stranded_bytes},
            ))
        return out
