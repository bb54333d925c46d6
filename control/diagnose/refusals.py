"""Refusals that repeat: a storm of the same ask, and an ask retried smaller after a refusal.

A refusal changes nothing, so asking again at once gets the same answer: a storm means a caller
that does not back off (or a budget that never moves). The design forbids retrying a refused
ask smaller behind the caller's back; the ledger shows it as a smaller ask for the same thing
within ``retry_window_ns``: a ``MoveRefused`` or ``MoveRequested`` whose causation is the refusal's
seq, or one for the same worker, tier and session planning fewer bytes.
NOTE: an ask with no session and no causation link is not matched by caller name alone: a policy
asks for different sizes all the time, and those are new asks, not retries.
"""
from __future__ import annotations

from collections import deque

from residency.events import MoveRefused, MoveRequested, Recorded
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


def _ask_words(ev: MoveRefused) -> str:
    who = f", session {ev.session}" if ev.session else ""
    return f"{ev.ask} on worker {ev.worker} {ev.tier}{who}"


class RefusalStorm:
    """The same ask (same caller, worker, tier, session and bytes) refused ``storm_refusals`` times
    within ``storm_window_ns``. Storms of one caller within ``storm_merge_gap_ns`` are one episode."""

    name = "refusal_storm"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.need = params.storm_refusals
        self.window = params.storm_window_ns
        self.gap = params.storm_merge_gap_ns
        self.recent: dict[tuple, deque] = {}     # exact ask -> deque[(ts, seq)] within the window
        self.open: dict[tuple, dict] = {}        # caller key -> episode
        self.done: list[dict] = []

    def handlers(self):
        return {MoveRefused: self._refused}

    def _refused(self, rec: Recorded) -> None:
        ev: MoveRefused = rec.event
        caller = (ev.ask, ev.worker, ev.tier, ev.session)
        exact = (*caller, ev.asked_bytes)
        ts, seq = rec.envelope.ts_ns, rec.envelope.seq
        q = self.recent.get(exact)
        if q is None:
            if len(self.recent) > 65536:
                self._forget(ts)
            q = self.recent[exact] = deque()
        q.append((ts, seq))
        while q[0][0] < ts - self.window:
            q.popleft()
        if len(q) < self.need:
            return
        ep = self.open.get(caller)
        if ep is not None and ts - ep["last_ns"] > self.gap:
            self.done.append(self.open.pop(caller))
            ep = None
        if ep is None:
            ep = self.open[caller] = {"onset_ns": q[0][0], "count": 0, "seqs": [], "asks": set(), "storms": 0}
        if len(q) == self.need:     # a new storm: its first refusals join the episode too
            ep["storms"] += 1
            ep["count"] += len(q)
            ep["seqs"].extend(s for _, s in q if len(ep["seqs"]) < MAX_PROOF_SEQS)
        else:
            ep["count"] += 1
            if len(ep["seqs"]) < MAX_PROOF_SEQS:
                ep["seqs"].append(seq)
        ep["asks"].add(ev.asked_bytes)
        ep["last_ns"] = ts
        ep["last"] = ev

    def _forget(self, ts: int) -> None:
        for key in [k for k, q in self.recent.items() if q[-1][0] < ts - self.window]:
            del self.recent[key]

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in [*self.done, *self.open.values()]:
            ev: MoveRefused = ep["last"]
            ongoing = at_ns - ep["last_ns"] <= self.gap
            asks = (f"the same ask of {fmt_bytes(ev.asked_bytes)}" if len(ep["asks"]) == 1
                    else f"{len(ep['asks'])} different asks, each")
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"{_ask_words(ev)}: {asks} refused {self.need}+ times within {fmt_duration(self.window)} "
                       f"({ep['count']} refusals in {ep['storms']} storm(s) over {fmt_duration(ep['last_ns'] - ep['onset_ns'])}; "
                       f"last: available {fmt_bytes(ev.available_bytes)}, floor {fmt_bytes(ev.floor_bytes)}: {ev.reason})"),
                seqs=proof(ep["seqs"]),
                subject=f"ask {ev.ask}",
                onset_ns=ep["onset_ns"],
                until_ns=None if ongoing else ep["last_ns"],
                suggestion=(f"the caller '{ev.ask}' repeats an ask the budget cannot fund: make it back off, "
                            f"or free room on worker {ev.worker}'s {ev.tier} first"),
                detail={"ask": ev.ask, "worker": ev.worker, "tier": ev.tier, "session": ev.session,
                        "num_refusals": ep["count"], "num_storms": ep["storms"], "asked_bytes": ev.asked_bytes,
                        "available_bytes": ev.available_bytes, "floor_bytes": ev.floor_bytes},
            ))
        return out


class RetriedSmaller:
    name = "retried_smaller"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.window = params.retry_window_ns
        self.by_session: dict[tuple, Recorded] = {}   # (worker, tier, session) -> largest recent refusal
        self.by_seq: dict[str, Recorded] = {}         # str(seq) -> refusal, for causation links
        self.episodes: dict[tuple, dict] = {}         # ask key -> episode

    def handlers(self):
        return {MoveRefused: self._refused, MoveRequested: self._requested}

    def _note(self, refusal: Recorded, retry: Recorded, retry_bytes: int, granted: bool) -> None:
        ev: MoveRefused = refusal.event
        key = (ev.ask, ev.worker, ev.tier, ev.session)
        ep = self.episodes.get(key)
        if ep is None:
            ep = self.episodes[key] = {"onset_ns": refusal.envelope.ts_ns, "count": 0, "granted": 0,
                                       "seqs": [], "refusal": ev, "smallest": retry_bytes}
        ep["count"] += 1
        ep["granted"] += granted
        ep["last_ns"] = retry.envelope.ts_ns
        ep["smallest"] = min(ep["smallest"], retry_bytes)
        if len(ep["seqs"]) < MAX_PROOF_SEQS:
            ep["seqs"] += [refusal.envelope.seq, retry.envelope.seq]

    def _recent(self, rec: Recorded | None, ts: int) -> Recorded | None:
        return rec if rec is not None and ts - rec.envelope.ts_ns <= self.window else None

    def _earlier(self, rec: Recorded, session: str | None, worker: int, tier: str) -> Recorded | None:
        ts = rec.envelope.ts_ns
        if rec.envelope.causation is not None:
            hit = self._recent(self.by_seq.get(rec.envelope.causation), ts)
            if hit is not None:
                return hit
        if session is not None and self.by_session:
            return self._recent(self.by_session.get((worker, tier, session)), ts)
        return None

    def _refused(self, rec: Recorded) -> None:
        ev: MoveRefused = rec.event
        prev = self._earlier(rec, ev.session, ev.worker, ev.tier)
        if prev is not None and ev.asked_bytes < prev.event.asked_bytes:
            self._note(prev, rec, ev.asked_bytes, granted=False)
        elif ev.session is not None:
            # the largest recent refusal is the one a smaller retry is measured against
            self.by_session[(ev.worker, ev.tier, ev.session)] = rec
        if len(self.by_seq) > 4096:
            self.by_seq.clear()
        self.by_seq[str(rec.envelope.seq)] = rec

    def _requested(self, rec: Recorded) -> None:
        ev: MoveRequested = rec.event
        refusal = self._earlier(rec, ev.session, ev.worker, ev.dst)
        if refusal is not None and ev.bytes_planned < refusal.event.asked_bytes:
            self._note(refusal, rec, ev.bytes_planned, granted=True)

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in self.episodes.values():
            ev: MoveRefused = ep["refusal"]
            granted = f", {ep['granted']} of them granted as moves" if ep["granted"] else ""
            out.append(Finding(
                detector=self.name,
                severity="warning",
                title=(f"refused ask {_ask_words(ev)} ({fmt_bytes(ev.asked_bytes)}) retried smaller "
                       f"{ep['count']} time(s), down to {fmt_bytes(ep['smallest'])}{granted}"),
                seqs=proof(ep["seqs"]),
                subject=f"ask {ev.ask}",
                onset_ns=ep["onset_ns"],
                until_ns=ep["last_ns"],
                suggestion=("a refusal must reach the caller unchanged: find who shrinks the ask "
                            "(policy or client) and make it surface the refusal instead"),
                detail={"ask": ev.ask, "worker": ev.worker, "tier": ev.tier, "session": ev.session,
                        "asked_bytes": ev.asked_bytes, "smallest_retry_bytes": ep["smallest"],
                        "num_retries": ep["count"], "num_granted": ep["granted"]},
            ))
        return out
