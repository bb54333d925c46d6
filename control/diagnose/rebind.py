"""A torn rebind: readers of one pool left on different generations.

A rebind is all readers or none. It is torn when the control plane says so (``RebindTorn``),
when it was committed while some reader never stamped the new generation (an invariant broken
in the ledger itself), or when it has been pending past ``rebind_timeout_ns`` with readers
already split between generations. A torn pool stays torn until a later rebind of the same
pool commits with every reader stamped: that commit is the recovery edge.
"""
from __future__ import annotations

from residency.events import (
    ReaderStamped, RebindCommitted, RebindRefused, RebindRequested, RebindTorn, Recorded, WorkerJoined,
)
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import Finding, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams

_SUGGEST = ("readers on different generations read the wrong pages: stop admitting to the pool, "
            "re-stamp the readers behind, or roll the pool back to the old generation")


class TornRebind:
    name = "torn_rebind"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.timeout = params.rebind_timeout_ns
        self.pending: dict[str, dict] = {}          # rebind_id -> state
        self.torn: dict[tuple[int, str], dict] = {}  # (worker, pool) -> torn episode
        self.healed: dict[tuple[int, str], dict] = {}  # (worker, pool) -> tears healed, aggregated

    def handlers(self):
        return {
            RebindRequested: self._requested,
            ReaderStamped: self._stamped,
            RebindCommitted: self._committed,
            RebindTorn: self._torn,
            RebindRefused: self._refused,
            WorkerJoined: self._joined,
        }

    def _refused(self, rec: Recorded) -> None:
        """The worker changed nothing: every reader is still at from_gen, the pool as usable as before."""
        self.pending.pop(rec.event.rebind_id, None)

    def _joined(self, rec: Recorded) -> None:
        """A new incarnation brings a new pool: the old one's pending or torn rebinds name memory
        that is gone (the fold closes them the same way)."""
        w = rec.event.worker
        for rid in [rid for rid, rb in self.pending.items() if rb["rec"].event.worker == w]:
            del self.pending[rid]
        for key in [k for k in self.torn if k[0] == w]:
            del self.torn[key]

    def _requested(self, rec: Recorded) -> None:
        ev: RebindRequested = rec.event
        self.pending[ev.rebind_id] = {"rec": rec, "gens": {r: ev.from_gen for r in ev.readers},
                                      "seqs": [rec.envelope.seq]}

    def _stamped(self, rec: Recorded) -> None:
        rb = self.pending.get(rec.event.rebind_id)
        if rb is not None:
            rb["gens"][rec.event.reader] = rec.event.gen
            rb["seqs"].append(rec.envelope.seq)

    @staticmethod
    def _behind(rb: dict) -> list[str]:
        to_gen = rb["rec"].event.to_gen
        return sorted(r for r, g in rb["gens"].items() if g != to_gen)

    def _open_torn(self, rb: dict, rec: Recorded, behind: list[str], how: str) -> None:
        req: RebindRequested = rb["rec"].event
        key = (req.worker, req.pool)
        if key in self.torn:
            return    # already torn; the first tear is the onset
        self.torn[key] = {"rb": rb, "onset_ns": rec.envelope.ts_ns, "behind": behind, "how": how,
                          "seqs": rb["seqs"] + [rec.envelope.seq]}

    def _committed(self, rec: Recorded) -> None:
        rb = self.pending.pop(rec.event.rebind_id, None)
        if rb is None:
            return
        req: RebindRequested = rb["rec"].event
        behind = self._behind(rb)
        if behind:
            self._open_torn(rb, rec, behind, "committed while readers were behind")
            return
        ep = self.torn.pop((req.worker, req.pool), None)
        if ep is not None:
            h = self.healed.setdefault((req.worker, req.pool), {"n": 0, "onset_ns": ep["onset_ns"], "seqs": [],
                                                                 "longest_ns": -1})
            h["n"] += 1
            h["until_ns"] = rec.envelope.ts_ns
            took = rec.envelope.ts_ns - ep["onset_ns"]
            if took > h["longest_ns"]:
                h["longest_ns"], h["longest"] = took, ep["rb"]["rec"].event.rebind_id
                h["seqs"] = ep["seqs"] + [rec.envelope.seq] + h["seqs"]

    def _torn(self, rec: Recorded) -> None:
        rb = self.pending.pop(rec.event.rebind_id, None)
        if rb is not None:
            self._open_torn(rb, rec, list(rec.event.readers_behind) or self._behind(rb), "recorded torn")

    def _finding(self, ep: dict) -> Finding:
        req: RebindRequested = ep["rb"]["rec"].event
        gens = ep["rb"]["gens"]
        split = ", ".join(f"{r}@{gens.get(r, '?')}" for r in ep["behind"][:6])
        return Finding(
            detector=self.name,
            severity="critical",
            title=(f"rebind {req.rebind_id} of pool {req.pool} on worker {req.worker} (gen {req.from_gen}\u2192{req.to_gen}) "
                   f"{ep['how']}: {len(ep['behind'])} reader(s) behind ({split})"),
            seqs=proof(ep["seqs"]),
            subject=f"pool {req.pool} on worker {req.worker}",
            onset_ns=ep["onset_ns"],
            until_ns=None,
            suggestion=_SUGGEST,
            detail={"rebind_id": req.rebind_id, "pool": req.pool, "worker": req.worker,
                    "to_gen": req.to_gen, "readers_behind": ep["behind"][:32]},
        )

    def finish(self, at_ns: int) -> list[Finding]:
        out = [self._finding(ep) for ep in self.torn.values()]
        for (worker, pool), h in self.healed.items():
            out.append(Finding(
                detector=self.name,
                severity="info",
                title=(f"{h['n']} rebind(s) of pool {pool} on worker {worker} were torn, each healed by a later "
                       f"complete rebind (longest: {h['longest']}, torn {fmt_duration(h['longest_ns'])})"),
                seqs=proof(h["seqs"]),
                subject=f"pool {pool} on worker {worker}",
                onset_ns=h["onset_ns"],
                until_ns=h["until_ns"],
                suggestion="tears heal only by the next rebind: find why readers miss the stamp (a reader that is busy or gone)",
                detail={"worker": worker, "pool": pool, "num_torn": h["n"], "longest_rebind": h["longest"],
                        "longest_torn_ns": h["longest_ns"]},
            ))
        for rb in self.pending.values():
            req: RebindRequested = rb["rec"].event
            started = rb["rec"].envelope.ts_ns
            behind = self._behind(rb)
            if at_ns - started < self.timeout or not behind:
                continue
            split = len(behind) < len(rb["gens"])
            out.append(Finding(
                detector=self.name,
                severity="critical" if split else "warning",
                title=(f"rebind {req.rebind_id} of pool {req.pool} on worker {req.worker} pending "
                       f"{fmt_duration(at_ns - started)}: {len(behind)} of {len(rb['gens'])} reader(s) still behind"
                       + (" while the others moved on" if split else "")),
                seqs=proof(rb["seqs"]),
                subject=f"pool {req.pool} on worker {req.worker}",
                onset_ns=started,
                until_ns=None,
                suggestion=_SUGGEST if split else "the rebind never started its readers: check the worker that owns the pool",
                detail={"rebind_id": req.rebind_id, "pool": req.pool, "worker": req.worker,
                        "to_gen": req.to_gen, "readers_behind": behind[:32]},
            ))
        return out
