"""Workers of one group whose step digests differ: onset, duration, recovery edge.

Ranks of a tensor-parallel group run the same step on the same batch, so their
``StepCompleted.batch_digest`` (and ``tables_digest``, their block tables, when said) for a step
number must match. A step is judged once every live
member has reported it (or once the group has moved ``_LAG`` steps past it). Divergence opens an
episode; the first later step on which the members agree again is the recovery edge, and the
finding carries the whole interval. While it persists the finding is ongoing (``until_ns=None``)
with its duration so far and the last step it was seen on: it is never said once and then dropped.

Membership: ``params.groups`` when given; else the group a ``WorkerJoined`` names (a rank of
``serve --tp N``); otherwise workers that ever agreed on the digest of a non-empty batch (independent data-parallel workers never do, and empty batches agree by accident,
so they do not count). ``GroupDiverged`` rows recorded by the control plane open episodes too,
under their own group name, and name their ranks as members; ``GroupStopped`` ends the episode
without a recovery. A ``GroupDiverged`` caught by the ranks' ballots (``caught_by="ballot"``) has
no ``StepCompleted`` behind it: the step did not run on any rank, and the finding says so, with
the ballot's round and the request whose digests differ.
"""
from __future__ import annotations

from residency.events import GroupDiverged, GroupStopped, Recorded, StepCompleted, WorkerJoined, WorkerLost
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import Finding, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams

_LAG = 4  # steps a straggler may trail the group before its step is judged without it


class GroupDivergence:
    name = "group_divergence"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.explicit: dict[int, str] = {w: g for g, ws in params.groups.items() for w in ws}
        self.joined: dict[int, str] = {}              # worker -> the group its WorkerJoined names
        # groups a GroupStopped ended: the steps their ranks still had in flight are not judged
        # again (the stop is the episode's edge) until one of their ranks joins anew
        self.stopped: set[str] = set()
        self.parent: dict[int, int] = {}              # union-find over workers (inferred groups)
        self.alias: dict[int, str] = {}               # component root -> name from GroupDiverged
        self.pending: dict[int, dict[int, tuple]] = {}  # step -> worker -> (digest, seq, ts, num_seqs)
        self.live: set[int] = set()
        self.open: dict[str, dict] = {}
        self.done: list[Finding] = []

    def handlers(self):
        return {
            WorkerJoined: self._joined,
            WorkerLost: self._lost,
            StepCompleted: self._step,
            GroupDiverged: self._diverged,
            GroupStopped: self._stopped,
        }

    # ------------------------------------------------------------ membership
    def _find(self, w: int) -> int:
        p = self.parent.setdefault(w, w)
        while p != self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        return p

    def _union(self, a: int, b: int) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.parent[hi] = lo
            if hi in self.alias and lo not in self.alias:
                self.alias[lo] = self.alias[hi]

    def _group_of(self, w: int) -> str | None:
        if self.explicit:
            return self.explicit.get(w)
        if w in self.joined:
            return self.joined[w]
        root = self._find(w)
        return self.alias.get(root, f"workers@{root}")

    def _joined(self, rec: Recorded) -> None:
        self.live.add(rec.event.worker)
        if rec.event.group:
            self.joined[rec.event.worker] = rec.event.group
        self.stopped.discard(self._group_of(rec.event.worker))

    def _lost(self, rec: Recorded) -> None:
        self.live.discard(rec.event.worker)

    # ------------------------------------------------------------ steps
    def _step(self, rec: Recorded) -> None:
        ev: StepCompleted = rec.event
        self.live.add(ev.worker)
        reports = self.pending.get(ev.step)
        if reports is None:
            reports = self.pending[ev.step] = {}
        digest = f"{ev.batch_digest}/{ev.tables_digest}" if ev.tables_digest else ev.batch_digest
        reports[ev.worker] = (digest, rec.envelope.seq, rec.envelope.ts_ns, ev.num_seqs)
        if len(reports) >= len(self.live):
            self._judge(ev.step, self.pending.pop(ev.step))
        horizon = ev.step - _LAG
        while self.pending:
            first = next(iter(self.pending))
            if first >= horizon:
                break
            self._judge(first, self.pending.pop(first))

    def _judge(self, step: int, reports: dict[int, tuple]) -> None:
        if len(reports) < 2:
            return
        if not self.explicit:
            by_digest: dict[str, int] = {}
            for w, (digest, _, _, num_seqs) in reports.items():
                if num_seqs > 0:
                    other = by_digest.setdefault(digest, w)
                    if other != w:
                        self._union(other, w)
        groups: dict[str, dict[int, tuple]] = {}
        for w, rep in reports.items():
            g = self._group_of(w)
            if g is not None:
                groups.setdefault(g, {})[w] = rep
        for g, members in groups.items():
            if len(members) < 2 or g in self.stopped:
                continue
            digests = {rep[0] for rep in members.values()}
            if len(digests) > 1:
                self._diverge(g, step, {str(w): rep[0] for w, rep in members.items()},
                              min(rep[2] for rep in members.values()), [rep[1] for rep in members.values()])
            elif g in self.open:
                last = max(members.values(), key=lambda rep: rep[1])
                self._recover(g, step, last[2], [rep[1] for rep in members.values()], "agree again")

    def _diverge(self, group: str, step: int, digests: dict[str, str], ts: int, seqs: list[int],
                 ballot: GroupDiverged | None = None) -> None:
        ep = self.open.get(group)
        if ep is None:
            ep = self.open[group] = {"onset_ns": ts, "first_step": step, "num_steps": 0, "seqs": [],
                                     "digests": digests, "ballot": ballot}
        ep["num_steps"] += 1
        ep["last_step"] = step
        ep["last_ns"] = ts
        ep["last_digests"] = digests
        if len(ep["seqs"]) < 16:
            ep["seqs"].extend(seqs)

    def _recover(self, group: str, step: int, ts: int, seqs: list[int], how: str) -> None:
        ep = self.open.pop(group)
        self.done.append(self._finding(group, ep, ts, until=(step, seqs, how)))

    def _diverged(self, rec: Recorded) -> None:
        ev: GroupDiverged = rec.event
        ranks = [int(r) for r in ev.digests_by_rank if r.isdigit()]
        if ranks and not self.explicit:
            for r in ranks[1:]:
                self._union(ranks[0], r)
            root = self._find(ranks[0])
            old = self.alias.get(root, f"workers@{root}")
            self.alias[root] = ev.group
            if old in self.open and ev.group not in self.open:
                self.open[ev.group] = self.open.pop(old)
        self._diverge(ev.group, ev.step, dict(ev.digests_by_rank), rec.envelope.ts_ns, [rec.envelope.seq],
                      ballot=ev if ev.caught_by == "ballot" else None)

    def _stopped(self, rec: Recorded) -> None:
        self.stopped.add(rec.event.group)
        if rec.event.group in self.open:
            self._recover(rec.event.group, -1, rec.envelope.ts_ns, [rec.envelope.seq], f"stopped: {rec.event.reason}")

    # ------------------------------------------------------------ findings
    def _finding(self, group: str, ep: dict, end_ns: int, until: tuple | None) -> Finding:
        digests = ep["last_digests"]
        split = ", ".join(f"rank {r}={'/'.join(p[:8] for p in d.split('/'))}" for r, d in sorted(digests.items())[:6])
        if until is not None:
            step, edge, how = until
            where = f"at step {step}" if step >= 0 else ""
            tail = f"; {how} {where}".rstrip()
        else:
            tail = f"; still diverged at step {ep['last_step']}"
            edge = []
        ballot: GroupDiverged | None = ep.get("ballot")
        caught = ""
        if ballot is not None:
            what = f"request {ballot.request_id}" if ballot.request_id else "an unreadable ballot"
            caught = (f"; caught before step {ballot.step} ran, by the ranks' ballots of round {ballot.round} "
                      f"for {what}")
        return Finding(
            detector=self.name,
            severity="info" if until is not None and until[0] >= 0 else ("warning" if until else "critical"),
            title=(f"group {group} diverged for {fmt_duration(end_ns - ep['onset_ns'])} "
                   f"({ep['num_steps']} step(s) from step {ep['first_step']}): {split}{caught}{tail}"),
            seqs=proof(ep["seqs"], key=list(edge)),
            subject=f"group {group}",
            onset_ns=ep["onset_ns"],
            until_ns=end_ns if until is not None else None,
            suggestion=("ranks computed different batches or block tables: compare their scheduler decisions at the "
                        "onset step; outputs produced meanwhile are suspect") if ballot is None else
                       ("the ranks held different views of one sequence (its block table, positions, awaited move or "
                        "weights) before the step: no rank ran it; compare the commands each rank was told for it"),
            detail={"group": group, "first_step": ep["first_step"], "last_diverged_step": ep["last_step"],
                    "num_steps_diverged": ep["num_steps"], "last_seen_ns": ep["last_ns"],
                    "recovered_at_step": until[0] if until is not None and until[0] >= 0 else None,
                    "caught_by": "ballot" if ballot is not None else "step",
                    "ballot_round": ballot.round if ballot is not None else None,
                    "request_id": ballot.request_id if ballot is not None else None},
        )

    def finish(self, at_ns: int) -> list[Finding]:
        # steps still pending are judged on the reports that arrived (finish ends the pass)
        for step in sorted(self.pending):
            self._judge(step, self.pending.pop(step))
        return self.done + [self._finding(g, ep, at_ns, until=None) for g, ep in self.open.items()]
