"""Detectors over moves: the wedge (a move in flight past its deadline) and the pendulum.

The wedge is the bug every KV-offload system has shipped: a command issued whose completion is
never recorded. The ledger shows it exactly: a ``MoveRequested`` with no terminal event and a
deadline behind "now". What matters to the operator is what waits behind it, so the finding
names the requests and sessions blocked on it and the moves queued after it on the same worker.
"""
from __future__ import annotations

from residency.events import (
    CopiesReleased,
    MoveAbandoned,
    MoveAcked,
    MoveFailed,
    MoveLateAcked,
    MoveRejected,
    MoveRequested,
    Recorded,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


def _move_words(req: MoveRequested) -> str:
    return f"{req.kind} {req.src}\u2192{req.dst} of {fmt_bytes(req.bytes_planned)} on worker {req.worker}"


class _PerWorker:
    """Many moves with the same problem on one worker make one finding, not hundreds."""

    def __init__(self) -> None:
        self.by_worker: dict[int, dict] = {}

    def add(self, worker: int, onset_ns: int, end_ns: int | None, seqs: list[int], nbytes: int,
            late_ns: int, move_id: str) -> None:
        agg = self.by_worker.get(worker)
        if agg is None:
            agg = self.by_worker[worker] = {"n": 0, "onset_ns": onset_ns, "end_ns": end_ns, "seqs": [],
                                            "bytes": 0, "worst_ns": -1, "worst": move_id, "worst_seqs": seqs}
        agg["n"] += 1
        agg["onset_ns"] = min(agg["onset_ns"], onset_ns)
        if end_ns is not None:
            agg["end_ns"] = max(agg["end_ns"] or end_ns, end_ns)
        agg["bytes"] += nbytes
        if late_ns > agg["worst_ns"]:
            agg["worst_ns"], agg["worst"], agg["worst_seqs"] = late_ns, move_id, seqs
        if len(agg["seqs"]) < MAX_PROOF_SEQS:
            agg["seqs"].extend(seqs)


class OverdueMoves:
    """A move in flight past its deadline, and what waits behind it: one finding per move.

    Per worker, as one finding each: moves that ended past their deadline without the watchdog
    ever stranding them (the watchdog has a gap), strandings still unresolved (bytes at risk), and
    strandings resolved by a late ack (how long those wedges lasted).
    """

    name = "overdue_move"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.params = params
        self.unstranded = _PerWorker()
        self.late_acked = _PerWorker()

    def handlers(self):
        return {
            MoveAcked: self._terminal,
            MoveFailed: self._terminal,
            MoveRejected: self._terminal,
            MoveAbandoned: self._terminal,
            MoveLateAcked: self._late_acked,
            CopiesReleased: self._released,
        }

    def _terminal(self, rec: Recorded) -> None:
        req_rec = self.acct.ended
        if req_rec is None:
            return
        req: MoveRequested = req_rec.event
        ts = rec.envelope.ts_ns
        late = ts - req.deadline_ns
        if late > self.params.late_grace_ns:
            self.unstranded.add(req.worker, req.deadline_ns, ts, [req_rec.envelope.seq, rec.envelope.seq],
                                req.bytes_planned, late, req.move_id)

    def _released(self, rec: Recorded) -> None:
        (self._late_acked if self.acct.is_late() else self._terminal)(rec)

    def _late_acked(self, rec: Recorded) -> None:
        req_rec, stranding = self.acct.ended, self.acct.ended_stranding
        if req_rec is None or stranding is None:
            return
        req: MoveRequested = req_rec.event
        ts = rec.envelope.ts_ns
        self.late_acked.add(req.worker, req.deadline_ns, ts,
                            [req_rec.envelope.seq, stranding.envelope.seq, rec.envelope.seq],
                            getattr(rec.event, "bytes_moved", 0), ts - req.deadline_ns, req.move_id)   # a release moves 0

    def _waiters(self, req_rec: Recorded) -> list[Recorded]:
        """Requests waiting on this move: same session, or linked by correlation or causation."""
        req: MoveRequested = req_rec.event
        found: dict[int, Recorded] = {}
        for key in (req.session, req.move_id, req_rec.envelope.correlation_id):
            if key:
                for r in self._waiting_by_key.get(key, ()):
                    found[r.envelope.seq] = r
        return [found[s] for s in sorted(found)]

    def finish(self, at_ns: int) -> list[Finding]:
        index: dict[str, list[Recorded]] = {}
        for r in self.acct.waiting.values():
            for key in {r.event.session, r.envelope.correlation_id, r.envelope.causation}:
                if key:
                    index.setdefault(key, []).append(r)
        self._waiting_by_key = index
        return self._wedged(at_ns) + self._stranded(at_ns) + self._aggregates()

    def _wedged(self, at_ns: int) -> list[Finding]:
        out = []
        by_worker: dict[int, list[Recorded]] = {}
        for r in self.acct.inflight.values():
            by_worker.setdefault(r.event.worker, []).append(r)
        for req_rec in self.acct.inflight.values():
            req: MoveRequested = req_rec.event
            if req.deadline_ns >= at_ns or req.worker in self.acct.lost:
                continue   # not yet late; a lost worker's moves are the worker detector's to name
            waiters = self._waiters(req_rec)
            behind = [r for r in by_worker[req.worker] if r.envelope.seq > req_rec.envelope.seq]
            blocked = []
            if waiters:
                blocked.append(f"{len(waiters)} request(s) waiting on it")
            if req.session:
                blocked.append(f"session {req.session}")
            if behind:
                blocked.append(f"{len(behind)} move(s) queued behind it")
            tail = f"; blocked: {', '.join(blocked)}" if blocked else ""
            out.append(Finding(
                detector=self.name,
                severity="critical",
                title=(f"move {req.move_id} ({_move_words(req)}) in flight "
                       f"{fmt_duration(at_ns - req.deadline_ns)} past its deadline with no ack{tail}"),
                seqs=proof([r.envelope.seq for r in waiters], key=[req_rec.envelope.seq]),
                subject=f"move {req.move_id}",
                onset_ns=req.deadline_ns,
                until_ns=None,
                suggestion=(f"worker {req.worker} never answered and no watchdog stranded it: check the worker's copy "
                            f"stream and the watchdog; strand the move so its {fmt_bytes(req.bytes_planned)} are accounted"),
                detail={"move_id": req.move_id, "worker": req.worker, "kind": req.kind,
                        "bytes_planned": req.bytes_planned, "session": req.session,
                        "requests_blocked": [r.event.request_id for r in waiters][:32],
                        "moves_behind": [r.event.move_id for r in behind][:32]},
            ))
        return out

    def _stranded(self, at_ns: int) -> list[Finding]:
        agg = _PerWorker()
        waiting_on: dict[int, int] = {}
        for move_id, (stranding, req_rec) in self.acct.stranded.items():
            if stranding.event.why == "worker_lost":
                continue   # named by the worker detector with the loss
            req: MoveRequested = req_rec.event
            agg.add(req.worker, req.deadline_ns, None, [req_rec.envelope.seq, stranding.envelope.seq],
                    stranding.event.bytes_at_risk, at_ns - req.deadline_ns, move_id)
            waiting_on[req.worker] = waiting_on.get(req.worker, 0) + len(self._waiters(req_rec))
        out = []
        for worker, a in agg.by_worker.items():
            waiters = f"; {waiting_on[worker]} request(s) waiting on them" if waiting_on.get(worker) else ""
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"{a['n']} move(s) on worker {worker} stranded at their deadline and never late-acked: "
                       f"{fmt_bytes(a['bytes'])} at risk (oldest {a['worst']}){waiters}"),
                seqs=proof(a["seqs"], key=a["worst_seqs"]),
                subject=f"worker {worker}",
                onset_ns=a["onset_ns"],
                until_ns=None,
                suggestion=(f"ask worker {worker} what became of these moves; their bytes stay counted as "
                            f"stranded (`residency audit stranded`) until it answers"),
                detail={"worker": worker, "num_moves": a["n"], "bytes_at_risk": a["bytes"], "oldest_move": a["worst"]},
            ))
        return out

    def _aggregates(self) -> list[Finding]:
        out = []
        for worker, a in self.unstranded.by_worker.items():
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"{a['n']} move(s) on worker {worker} ended past their deadline and were never stranded "
                       f"(worst: {a['worst']}, {fmt_duration(a['worst_ns'])} late)"),
                seqs=proof(a["seqs"], key=a["worst_seqs"]),
                subject=f"worker {worker}",
                onset_ns=a["onset_ns"],
                until_ns=a["end_ns"],
                suggestion="the watchdog missed these deadlines: check that it runs and that its tick is shorter than move deadlines",
                detail={"worker": worker, "num_moves": a["n"], "worst_move": a["worst"], "worst_late_ns": a["worst_ns"]},
            ))
        for worker, a in self.late_acked.by_worker.items():
            out.append(Finding(
                detector=self.name,
                severity="info",
                title=(f"{a['n']} stranded move(s) on worker {worker} were late-acked, "
                       f"up to {fmt_duration(a['worst_ns'])} past the deadline (worst: {a['worst']}); "
                       f"{fmt_bytes(a['bytes'])} re-accounted"),
                seqs=proof(a["seqs"], key=a["worst_seqs"]),
                subject=f"worker {worker}",
                onset_ns=a["onset_ns"],
                until_ns=a["end_ns"],
                suggestion=f"worker {worker}'s copies run slower than the deadlines allow: batch pages or lengthen the deadlines",
                detail={"worker": worker, "num_moves": a["n"], "worst_move": a["worst"], "worst_late_ns": a["worst_ns"],
                        "bytes_moved": a["bytes"]},
            ))
        return out


class Pendulum:
    """The same blocks sent off the device and brought back, again and again, within a window.

    A block's direction is "out" for a move from the device, "in" for a move to it. Each change of
    direction is a swing; ``pendulum_round_trips`` round trips (twice as many swings) within
    ``pendulum_window_ns`` marks the block. Marked blocks on one worker, close in time, are one episode.

    NOTE: an idle session parked (``policy:park``, "idle ...") and restored by the serving path for
    a request that needs it (its own next turn, or a turn reusing a retained prefix) is the design
    working, not a swing: that round trip is not counted. A restore after a spill, an eviction or a
    park made for someone else's room is.
    """

    name = "pendulum"
    OUT, IN, IDLE_OUT = 0, 1, 2

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.params = params
        self.need = 2 * params.pendulum_round_trips
        self.window = params.pendulum_window_ns
        self.blocks: dict[int, dict[int, list]] = {}      # worker -> block -> [last_dir, ts, seq, ts, seq, ...]
        self.num_tracked = 0
        self.sweep_at = 1 << 16
        self.swung: dict[int, tuple[int, int, str]] = {}    # seq -> (ts, bytes planned, who asked) of moves that swung
        self.open: dict[int, dict] = {}                    # worker -> episode
        self.done: list[dict] = []

    def handlers(self):
        return {MoveRequested: self._requested}

    def _requested(self, rec: Recorded) -> None:
        ev: MoveRequested = rec.event
        cause = rec.envelope.causation or ""
        demand = False
        if ev.src == "device" and ev.dst != "device":
            idle = ev.kind == "park" and (cause == "policy:park" or ev.reason.startswith("idle"))
            direction = self.IDLE_OUT if idle else self.OUT
        elif ev.dst == "device" and ev.src != "device":
            direction = self.IN
            demand = ev.kind == "restore" and cause.startswith("serving")
        else:
            return
        ts, seq = rec.envelope.ts_ns, rec.envelope.seq
        states = self.blocks.get(ev.worker)
        if states is None:
            states = self.blocks[ev.worker] = {}
        horizon = ts - self.window
        full = 1 + 2 * self.need
        marked = []
        swung = False
        # NOTE: the hot loop of the pendulum (a million block moves per million events). A block's
        # state is one flat list, no deque and no tuples:
        #     [last_dir, ts, seq, ts, seq, ...]   the last `need` direction changes inside the window
        for b in ev.blocks:
            st = states.get(b)
            if st is None:
                states[b] = [direction, ts, seq]
                self.num_tracked += 1
                swung = True                # its first sighting may become the first swing
                continue
            last = st[0]
            if (last == self.IN) == (direction == self.IN):
                continue
            if demand and last == self.IDLE_OUT:
                st[0] = direction           # an idle park undone by demand: drop the park's swing
                if len(st) > 3:
                    del st[-2:]
                else:
                    st[1], st[2] = ts, seq
                continue
            st[0] = direction
            st.append(ts)
            st.append(seq)
            swung = True
            if len(st) > full:
                del st[1:3]
            while st[1] < horizon:
                del st[1:3]
            if len(st) == full:
                marked.append((b, st))
        if swung or marked:
            self.swung[seq] = (ts, ev.bytes_planned, cause.partition(":")[0] or "unknown")
            if len(self.swung) > self.sweep_at:
                for q in [q for q, (t, _, _) in self.swung.items() if t < horizon]:
                    del self.swung[q]
        if marked:
            self._mark(ev, rec, marked)
        if self.num_tracked >= self.sweep_at:
            self._sweep(horizon)

    def _sweep(self, horizon: int) -> None:
        """Forget blocks whose last swing left the window: a million blocks must not cost a million lists."""
        for states in self.blocks.values():
            for b in [b for b, st in states.items() if st[-2] < horizon]:
                del states[b]
        self.num_tracked = sum(len(s) for s in self.blocks.values())
        self.sweep_at = max(1 << 16, 2 * self.num_tracked)
        for seq in [q for q, (ts, _, _) in self.swung.items() if ts < horizon]:
            del self.swung[seq]

    def _mark(self, ev: MoveRequested, rec: Recorded, marked: list) -> None:
        ts = rec.envelope.ts_ns
        ep = self.open.get(ev.worker)
        if ep is not None and ts - ep["last_ns"] > self.window:
            self.done.append(ep)
            ep = None
        if ep is None:
            ep = self.open[ev.worker] = {"worker": ev.worker, "onset_ns": min(st[1] for _, st in marked),
                                         "blocks": set(), "seqs": [], "num_swings": 0, "bytes": 0,
                                         "sessions": set(), "last_ns": ts, "moves": set(), "callers": {}}
        ep["blocks"].update(b for b, _ in marked)
        for _, st in marked:
            for q in st[2::2]:
                if q in ep["moves"]:
                    continue
                ep["moves"].add(q)
                hit = self.swung.get(q)
                if hit is not None:         # every move that swung a marked block, counted once
                    ep["bytes"] += hit[1]
                    ep["callers"][hit[2]] = ep["callers"].get(hit[2], 0) + 1
                if len(ep["seqs"]) < 64:
                    ep["seqs"].append(q)
        ep["num_swings"] += 1
        if ev.session:
            ep["sessions"].add(ev.session)
        ep["last_ns"] = ts

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in [*self.done, *self.open.values()]:
            ongoing = at_ns - ep["last_ns"] <= self.window
            sessions = sorted(ep["sessions"])
            who = f" (sessions {', '.join(sessions[:3])}{'…' if len(sessions) > 3 else ''})" if sessions else ""
            asked = ", ".join(f"{c} ({n})" for c, n in sorted(ep["callers"].items(), key=lambda kv: -kv[1])) or "unknown"
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"{len(ep['blocks'])} block(s) on worker {ep['worker']} swung between device and a slower "
                       f"tier {self.params.pendulum_round_trips}+ times within {fmt_duration(self.window)}{who}; "
                       f"{len(ep['moves'])} swinging moves planned {fmt_bytes(ep['bytes'])}, asked by {asked}"),
                seqs=proof(ep["seqs"]),
                subject=f"worker {ep['worker']}",
                onset_ns=ep["onset_ns"],
                until_ns=None if ongoing else ep["last_ns"],
                suggestion="the policy evicts blocks it needs again: raise the device floor for hot sessions or add hysteresis to spill decisions",
                detail={"worker": ep["worker"], "num_blocks": len(ep["blocks"]),
                        "blocks": sorted(ep["blocks"])[:32], "sessions": sessions[:32],
                        "bytes_moved": ep["bytes"], "num_moves": len(ep["moves"]),
                        "asked_by": sorted(ep["callers"])},
            ))
        return out
