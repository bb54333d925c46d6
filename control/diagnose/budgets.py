"""Budgets broken: pinned host bytes over the host ceiling, device free bytes under the floor,
and pin counts gone negative.

NOTE: a budget's ``floor_bytes`` is read as the free headroom a tier must keep (the same floor a
``MoveRefused`` quotes: refused when ``available - asked < floor``), so "device below its floor"
means the device's free bytes (capacity - used) fell under it. Pinned host bytes are the sum of
``PinnedRegistered`` less ``PinnedReleased`` (the host pool registers itself whole, so block copies
on the host tier live inside a registration and are not added again); the budget is the host
``BudgetSet`` ceiling, or the host capacity when no budget was set.
"""
from __future__ import annotations

from residency.events import BudgetSet, PinnedRegistered, PinnedReleased, Recorded, WorkerJoined
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import MAX_PROOF_SEQS, Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


class _Episodes:
    """Intervals per worker while a condition holds; remembers the extreme value.

    A condition that clears and comes back within ``merge_gap_ns`` continues the same episode
    (``num_dips`` counts the returns), so a tier hovering at its limit is one finding, not hundreds.
    """

    def __init__(self, merge_gap_ns: int) -> None:
        self.gap = merge_gap_ns
        self.open: dict[int, dict] = {}       # worker -> episode (with "until" set while it is clear)
        self.done: list[tuple[int, dict]] = []

    def update(self, worker: int, rec: Recorded, bad: bool, value: int, worst) -> None:
        ep = self.open.get(worker)
        ts = rec.envelope.ts_ns
        if bad:
            if ep is not None and ep.get("until") is not None:
                if ts - ep["until"].envelope.ts_ns <= self.gap:
                    ep["until"] = None
                    ep["num_dips"] += 1
                else:
                    self.done.append((worker, self.open.pop(worker)))
                    ep = None
            if ep is None:
                ep = self.open[worker] = {"onset_ns": ts, "seqs": [rec.envelope.seq], "worst": value,
                                          "until": None, "num_dips": 1}
            else:
                ep["worst"] = worst(ep["worst"], value)
                if len(ep["seqs"]) < 8:
                    ep["seqs"].append(rec.envelope.seq)
        elif ep is not None and ep.get("until") is None:
            ep["until"] = rec

    def all(self):
        return [*self.done, *self.open.items()]


class PinnedOverBudget:
    name = "pinned_over_budget"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        self.pins: dict[int, dict[str, int]] = {}       # worker -> owner -> bytes
        self.ceiling: dict[int, tuple[int, int]] = {}   # worker -> (ceiling_bytes, seq of BudgetSet)
        self.episodes = _Episodes(params.merge_gap_ns)
        self.negative: dict[tuple[int, str], dict] = {}
        self.limit: dict[int, int] = {}                 # worker -> its pinned budget's limit (WorkerJoined)

    def handlers(self):
        return {BudgetSet: self._budget, PinnedRegistered: self._pinned, PinnedReleased: self._released,
                WorkerJoined: self._joined}

    def _joined(self, rec: Recorded) -> None:
        # a (re)joined worker starts with no pinned registrations, as in the fold
        self.pins[rec.event.worker] = {}
        limit = getattr(rec.event, "pinned_limit_bytes", None)
        if limit is not None:
            self.limit[rec.event.worker] = limit
        self._check(rec, rec.event.worker)

    def _budget_of(self, worker: int) -> int | None:
        # a host ceiling set; else the limit of the worker's own pinned budget (its host pool and
        # rings); else, for a worker that never said it, the host tier's capacity
        c = self.ceiling.get(worker)
        if c is not None:
            return c[0]
        return self.limit.get(worker, self.acct.capacity.get((worker, "host")))

    def _check(self, rec: Recorded, worker: int) -> None:
        budget = self._budget_of(worker)
        if budget is None:
            return
        pinned = sum(self.pins.get(worker, {}).values())
        self.episodes.update(worker, rec, pinned > budget, pinned, max)

    def _budget(self, rec: Recorded) -> None:
        ev: BudgetSet = rec.event
        if ev.tier == "host":
            self.ceiling[ev.worker] = (ev.ceiling_bytes, rec.envelope.seq)
            self._check(rec, ev.worker)

    def _pinned(self, rec: Recorded) -> None:
        ev: PinnedRegistered = rec.event
        owners = self.pins.setdefault(ev.worker, {})
        owners[ev.owner] = owners.get(ev.owner, 0) + ev.bytes
        self._check(rec, ev.worker)

    def _released(self, rec: Recorded) -> None:
        ev: PinnedReleased = rec.event
        owners = self.pins.setdefault(ev.worker, {})
        left = owners.get(ev.owner, 0) - ev.bytes
        if left < 0:
            # NOTE: a release of more than was registered is the "pin count went negative" bug;
            # counting it as zero would hide it, so it is named and the count clamps at zero.
            neg = self.negative.setdefault((ev.worker, ev.owner), {"onset_ns": rec.envelope.ts_ns, "seqs": [],
                                                                   "excess": 0})
            neg["excess"] += -left
            if len(neg["seqs"]) < MAX_PROOF_SEQS:
                neg["seqs"].append(rec.envelope.seq)
            left = 0
        owners[ev.owner] = left
        self._check(rec, ev.worker)

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for worker, ep in self.episodes.all():
            until = ep.get("until")
            budget = self._budget_of(worker)
            c = self.ceiling.get(worker)
            seqs = ep["seqs"] + ([c[1]] if c else []) + ([until.envelope.seq] if until else [])
            end = until.envelope.ts_ns if until else at_ns
            out.append(Finding(
                detector=self.name,
                severity="warning" if until else "critical",
                title=(f"pinned host bytes on worker {worker} over budget for {fmt_duration(end - ep['onset_ns'])}"
                       + (f" ({ep['num_dips']} times)" if ep["num_dips"] > 1 else "") + ": "
                       f"peak {fmt_bytes(ep['worst'])} > {fmt_bytes(budget)} "
                       f"({'host ceiling' if c else 'host capacity, no budget set'})"),
                seqs=proof(seqs),
                subject=f"worker {worker}",
                onset_ns=ep["onset_ns"],
                until_ns=end if until else None,
                suggestion="spill host blocks to disk or release idle pinned buffers; pinned RAM over budget starves the OS page cache",
                detail={"worker": worker, "peak_bytes": ep["worst"], "budget_bytes": budget},
            ))
        for (worker, owner), neg in self.negative.items():
            out.append(Finding(
                detector=self.name,
                severity="critical",
                title=f"pin count of '{owner}' on worker {worker} went negative: {fmt_bytes(neg['excess'])} released more than registered",
                seqs=proof(neg["seqs"]),
                subject=f"worker {worker}",
                onset_ns=neg["onset_ns"],
                until_ns=None,
                suggestion=f"'{owner}' releases what it never registered (a double free or a missed registration): audit its pin/unpin pairs",
                detail={"worker": worker, "owner": owner, "excess_bytes": neg["excess"]},
            ))
        return out


class DeviceBelowFloor:
    name = "device_below_floor"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.acct = acct
        acct.usage_listeners.append(self._usage)
        self.floor: dict[int, tuple[int, int]] = {}     # worker -> (floor_bytes, seq of BudgetSet)
        self.episodes = _Episodes(params.merge_gap_ns)

    def handlers(self):
        return {BudgetSet: self._budget}

    def _check(self, rec: Recorded, worker: int) -> None:
        f = self.floor.get(worker)
        free = self.acct.free_bytes(worker, "device")
        if f is None or free is None:
            return
        self.episodes.update(worker, rec, free < f[0], free, min)

    def _usage(self, rec: Recorded, worker: int, tier: str, used: int) -> None:
        if tier == "device" and worker in self.floor:
            self._check(rec, worker)

    def _budget(self, rec: Recorded) -> None:
        ev: BudgetSet = rec.event
        if ev.tier == "device":
            self.floor[ev.worker] = (ev.floor_bytes, rec.envelope.seq)
            self._check(rec, ev.worker)

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for worker, ep in self.episodes.all():
            until = ep.get("until")
            floor, budget_seq = self.floor.get(worker, (0, None))
            end = until.envelope.ts_ns if until else at_ns
            seqs = ep["seqs"] + ([budget_seq] if budget_seq else []) + ([until.envelope.seq] if until else [])
            out.append(Finding(
                detector=self.name,
                severity="warning" if until else "critical",
                title=(f"worker {worker}'s device free bytes below its floor for {fmt_duration(end - ep['onset_ns'])}"
                       + (f" ({ep['num_dips']} dips)" if ep["num_dips"] > 1 else "")
                       + f": lowest {fmt_bytes(ep['worst'])} free < floor {fmt_bytes(floor)}"),
                seqs=proof(seqs),
                subject=f"worker {worker}",
                onset_ns=ep["onset_ns"],
                until_ns=end if until else None,
                suggestion="decode growth has no headroom: spill or park idle sessions, or lower admission until the floor is back",
                detail={"worker": worker, "lowest_free_bytes": ep["worst"], "floor_bytes": floor,
                        "num_dips": ep["num_dips"]},
            ))
        return out
