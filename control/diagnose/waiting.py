"""Work that waits and the room that never comes: requests queued for device pages, and tiers
that refuse every ask for longer than callers can usefully wait.

A queue is seen per worker from ``RequestQueued`` (recorded once per request, when it starts to
wait) to the moment its last queued request leaves (admitted, refused or finished). Why no room
comes is read from the same stretch of ledger: the parks the scheduler asked for, and the
refusals of those parks with the budget's arithmetic.

A full tier is seen from ``MoveRefused`` rows: every ask into (worker, tier) refused, none funded,
over at least ``tier_full_after_ns``. Unlike a refusal storm it does not need the caller to
repeat itself quickly: callers that back off (a park asked again every few seconds, a policy
every few more) against a tier that stays full are exactly what it finds.
"""
from __future__ import annotations

from residency.events import (
    BudgetSet,
    MoveAcked,
    MoveRefused,
    MoveRequested,
    Recorded,
    RequestAdmitted,
    RequestFinished,
    RequestQueued,
    RequestRefused,
    ServerStarted,
    ServerStopped,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


def _refusal_words(ev: MoveRefused) -> str:
    return (f"asked {fmt_bytes(ev.asked_bytes)}, available {fmt_bytes(ev.available_bytes)} "
            f"above a floor of {fmt_bytes(ev.floor_bytes)} ({ev.reason})")


class Queued:
    """Requests waiting for room on one worker, the oldest for at least ``queued_after_ns``."""

    name = "queued"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.after = params.queued_after_ns
        self.where: dict[str, int] = {}            # request_id -> worker it is queued on
        self.open: dict[int, dict] = {}            # worker -> episode
        self.done: list[dict] = []

    def handlers(self):
        return {
            RequestQueued: self._queued,
            RequestAdmitted: self._left,
            RequestRefused: self._left,
            RequestFinished: self._left,
            MoveRefused: self._refused,
            MoveAcked: self._acked,
            ServerStarted: self._server_edge,
            ServerStopped: self._server_edge,
        }

    def _queued(self, rec: Recorded) -> None:
        ev: RequestQueued = rec.event
        ep = self.open.get(ev.worker)
        if ep is None:
            ep = self.open[ev.worker] = {
                "worker": ev.worker, "onset_ns": rec.envelope.ts_ns, "onset_seq": rec.envelope.seq,
                "first": ev, "queued": set(), "num_requests": 0, "num_admitted": 0, "num_refused": 0,
                "num_finished": 0, "seqs": [], "parks": set(), "park_refusals": [], "parks_done": 0}
        ep["queued"].add(ev.request_id)
        ep["num_requests"] += 1
        ep["parks"].update(ev.parks)
        if len(ep["seqs"]) < MAX_PROOF_SEQS:
            ep["seqs"].append(rec.envelope.seq)
        self.where[ev.request_id] = ev.worker

    def _left(self, rec: Recorded) -> None:
        w = self.where.pop(rec.event.request_id, None)
        ep = self.open.get(w) if w is not None else None
        if ep is None:
            return
        kind = {RequestAdmitted: "num_admitted", RequestRefused: "num_refused"}.get(type(rec.event), "num_finished")
        ep[kind] += 1
        ep["queued"].discard(rec.event.request_id)
        if len(ep["seqs"]) < MAX_PROOF_SEQS:
            ep["seqs"].append(rec.envelope.seq)
        if not ep["queued"]:
            ep["until_ns"], ep["until_seq"] = rec.envelope.ts_ns, rec.envelope.seq
            self.done.append(self.open.pop(w))

    def _refused(self, rec: Recorded) -> None:
        ev: MoveRefused = rec.event
        ep = self.open.get(ev.worker)
        if ep is not None and ev.session is not None and ev.session in ep["parks"]:
            ep["park_refusals"].append(rec)
            del ep["park_refusals"][:-MAX_PROOF_SEQS]

    def _acked(self, rec: Recorded) -> None:
        req = self.acct.ended
        if req is None or req.event.kind != "park":
            return
        ep = self.open.get(req.event.worker)
        if ep is not None and req.event.session in ep["parks"]:
            ep["parks_done"] += 1

    def _server_edge(self, rec: Recorded) -> None:
        for w, ep in list(self.open.items()):
            ep["until_ns"], ep["until_seq"] = rec.envelope.ts_ns, rec.envelope.seq
            ep["ended_by_server"] = True
            self.done.append(self.open.pop(w))
        self.where.clear()

    def _cause(self, ep: dict) -> str:
        first: RequestQueued = ep["first"]
        if ep["park_refusals"]:
            last: MoveRefused = ep["park_refusals"][-1].event
            sessions = sorted({r.event.session for r in ep["park_refusals"]})
            return (f"the park of session(s) {', '.join(sessions[:3])} that would make room was refused "
                    f"{len(ep['park_refusals'])} time(s) by worker {last.worker}'s {last.tier} budget: "
                    f"{_refusal_words(last)}")
        if ep["parks"] and not ep["parks_done"]:
            return f"the park of {', '.join(sorted(ep['parks'])[:3])} that would make room never landed"
        if first.needed_blocks and not first.parks:
            return (f"needs {first.needed_blocks} device pages, {first.free_blocks} free, and no idle session "
                    f"to park: the pages belong to running requests")
        return first.waiting_for

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in [*self.done, *self.open.values()]:
            ongoing = "until_ns" not in ep
            end_ns = at_ns if ongoing else ep["until_ns"]
            if end_ns - ep["onset_ns"] < self.after:
                continue
            w = ep["worker"]
            running = sum(1 for r in self.acct.waiting.values() if r.event.worker in (w, None)) if ongoing else None
            if ongoing:
                severity = "critical" if running == 0 else "warning"
            else:
                severity = "warning" if ep["num_refused"] else "info"
            outcome = (f"{len(ep['queued'])} still waiting, {running} running on worker {w}" if ongoing else
                       f"then {ep['num_admitted']} admitted, {ep['num_refused']} refused, "
                       f"{ep['num_finished']} left by their client"
                       + (", the rest at the server's stop or restart" if ep.get("ended_by_server") else ""))
            cause = self._cause(ep)
            key = [ep["onset_seq"]] + [r.envelope.seq for r in ep["park_refusals"][-1:]]
            out.append(Finding(
                detector=self.name,
                severity=severity,
                title=(f"{ep['num_requests']} request(s) waited for room on worker {w}'s device since seq "
                       f"{ep['onset_seq']} ({outcome}); {cause}"),
                seqs=proof(ep["seqs"] + [r.envelope.seq for r in ep["park_refusals"]], key=key),
                subject=f"worker {w}",
                onset_ns=ep["onset_ns"],
                until_ns=None if ongoing else ep["until_ns"],
                suggestion=(f"room on worker {w}'s device comes only from parks, finished requests or a smaller "
                            "batch: free the tier the parks go to, or lower the requests' max_tokens"
                            if ep["park_refusals"] or running == 0 else
                            "requests wait behind running ones: this is load, not a wedge, unless it persists"),
                detail={"worker": w, "onset_seq": ep["onset_seq"], "num_requests": ep["num_requests"],
                        "num_waiting": len(ep["queued"]), "num_running": running,
                        "num_admitted": ep["num_admitted"], "num_refused": ep["num_refused"],
                        "waiting_for": ep["first"].waiting_for, "cause": cause,
                        "parks": sorted(ep["parks"])[:32],
                        "park_refusal_seqs": [r.envelope.seq for r in ep["park_refusals"]]},
            ))
        return out


class TierFull:
    """Every ask into one tier of one worker refused, and none funded, for ``tier_full_after_ns``."""

    name = "tier_full"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.after = params.tier_full_after_ns
        self.storm_need = params.storm_refusals
        self.storm_window = params.storm_window_ns
        self.ceiling: dict[tuple[int, str], int] = {}
        self.open: dict[tuple[int, str], dict] = {}
        self.done: list[dict] = []

    def handlers(self):
        return {MoveRefused: self._refused, MoveRequested: self._requested, BudgetSet: self._budget}

    def _budget(self, rec: Recorded) -> None:
        ev: BudgetSet = rec.event
        self.ceiling[(ev.worker, ev.tier)] = ev.ceiling_bytes

    def _refused(self, rec: Recorded) -> None:
        ev: MoveRefused = rec.event
        key = (ev.worker, ev.tier)
        ts = rec.envelope.ts_ns
        ep = self.open.get(key)
        if ep is None:
            ep = self.open[key] = {"worker": ev.worker, "tier": ev.tier, "onset_ns": ts, "onset_seq": rec.envelope.seq,
                                   "count": 0, "seqs": [], "callers": {}, "repeats": {}, "sessions": set(),
                                   "hurried": set()}
        ep["count"] += 1
        if len(ep["seqs"]) < MAX_PROOF_SEQS:
            ep["seqs"].append(rec.envelope.seq)
        ep["callers"][ev.ask] = ep["callers"].get(ev.ask, 0) + 1
        times = ep["repeats"].setdefault((ev.ask, ev.session), [])     # one caller asking again for one thing
        times.append(ts)
        del times[:-self.storm_need]
        if len(times) == self.storm_need and times[-1] - times[0] <= self.storm_window:
            ep["hurried"].add(ev.ask)
        if ev.session is not None:
            ep["sessions"].add(ev.session)
        ep["last"], ep["last_ns"], ep["last_seq"] = ev, ts, rec.envelope.seq
        ep["used"] = self.acct.used_bytes(ev.worker, ev.tier)

    def _requested(self, rec: Recorded) -> None:
        ev: MoveRequested = rec.event
        if ev.src == ev.dst:
            return                        # a release brings nothing into the tier
        ep = self.open.pop((ev.worker, ev.dst), None)
        if ep is not None:
            ep["funded_ns"], ep["funded_seq"] = rec.envelope.ts_ns, rec.envelope.seq
            self.done.append(ep)

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in [*self.done, *self.open.values()]:
            if ep["last_ns"] - ep["onset_ns"] < self.after:
                continue
            w, tier, last = ep["worker"], ep["tier"], ep["last"]
            ongoing = "funded_ns" not in ep and at_ns - ep["last_ns"] <= self.after
            until = None if ongoing else ep.get("funded_ns", ep["last_ns"])
            cap = self.acct.capacity.get((w, tier))
            ceiling = self.ceiling.get((w, tier)) or 0
            limit = ceiling if ceiling and (cap is None or ceiling < cap) else cap
            callers = sorted(ep["callers"])
            sessions = sorted(ep["sessions"])
            queued = sum(1 for r in self.acct.queued.values()
                         if r.event.worker == w and set(r.event.parks) & ep["sessions"]) if ongoing else 0
            who = f"asked by {', '.join(callers[:4])}" + (f" for session(s) {', '.join(sessions[:3])}" if sessions else "")
            if queued:
                who += f"; {queued} queued request(s) wait on those parks"
            if ep["hurried"]:
                advice = (f"{', '.join(sorted(ep['hurried']))} asks again at once: make it back off; and free room on "
                          f"worker {w}'s {tier} (demote or evict what sits there) or raise its limit")
            else:
                advice = (f"the callers already back off, so waiting longer will not help: free room on worker {w}'s "
                          f"{tier} (demote or evict what sits there) or raise its limit (ctl budget)")
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"worker {w}'s {tier} refused every ask for {fmt_duration(ep['last_ns'] - ep['onset_ns'])} "
                       f"({ep['count']} refusals, none funded; {who}): limit {fmt_bytes(limit)}, "
                       f"used {fmt_bytes(ep['used'])}, floor {fmt_bytes(last.floor_bytes)}; last {_refusal_words(last)}"),
                seqs=proof(ep["seqs"], key=[ep["onset_seq"], ep["last_seq"]]),
                subject=f"worker {w} {tier}",
                onset_ns=ep["onset_ns"],
                until_ns=until,
                suggestion=advice,
                detail={"worker": w, "tier": tier, "onset_seq": ep["onset_seq"], "num_refusals": ep["count"],
                        "callers": callers[:32], "sessions": sessions[:32], "limit_bytes": limit,
                        "used_bytes": ep["used"], "floor_bytes": last.floor_bytes,
                        "available_bytes": last.available_bytes, "asked_bytes": last.asked_bytes,
                        "num_queued": queued, "callers_back_off": not ep["hurried"]},
            ))
        return out
