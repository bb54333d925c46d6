"""Experts of an offloaded MoE model, read from the ledger's ``ExpertsMoved`` events.

    ExpertLedger   an observer: every (worker, layer, expert)'s tier over time, its fetches,
                   prefetches and evictions, the device bytes of each worker's experts as a series;
                   ``residency audit experts`` and the report read it
    ExpertThrash   a detector: an expert fetched and evicted again and again within a window

Every expert keeps a host copy for the worker's life (``ExpertsMoved.host_bytes``); what moves is
its device copy: a fetch or prefetch puts it in a slot, an evict takes it out. A worker's new
incarnation (``WorkerJoined``) starts with empty slots: the old device copies went with the process.
"""
from __future__ import annotations

from array import array

from residency.events import ExpertsMoved, Recorded, WorkerJoined
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.findings import Finding, fmt_bytes, fmt_duration, proof
from residency.control.diagnose.params import DiagnoseParams


class WorkerExperts:
    """One worker's experts as the ledger tells it."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.num_layers = self.num_experts = 0
        self.expert_bytes = 0
        self.host_bytes = 0
        self.since: dict[tuple[int, int], int] = {}          # (layer, expert) on the device -> since ts
        self.device_ns: dict[tuple[int, int], int] = {}      # (layer, expert) -> time on the device, closed spells
        self.counts: dict[tuple[int, int], list[int]] = {}   # (layer, expert) -> [fetches, prefetches, evictions]
        self.copied_bytes = 0
        self.copy_ns = 0                                      # measured copy time of the copies that were timed
        self.timed_bytes = 0
        self.demand_bytes = 0                                 # copied by fetches (a layer waited for them)
        self.served_device_bytes = 0
        self.served_fetched_bytes = 0
        self.num_events = 0
        self.first_ts: int | None = None
        self.last_ts: int | None = None
        self.series_ts = array("q")                           # device expert bytes after each event
        self.series_bytes = array("q")

    @property
    def device_bytes(self) -> int:
        return len(self.since) * self.expert_bytes

    def moved(self, ts: int, e: ExpertsMoved) -> None:
        self.num_events += 1
        self.first_ts = ts if self.first_ts is None else self.first_ts
        self.last_ts = ts
        self.num_layers, self.num_experts, self.host_bytes = e.num_layers, e.num_experts, e.host_bytes
        self.served_device_bytes += e.served_device_bytes
        self.served_fetched_bytes += e.served_fetched_bytes
        for m in e.moves:
            key = (m.layer, m.expert)
            self.expert_bytes = m.bytes
            c = self.counts.get(key)
            if c is None:
                c = self.counts[key] = [0, 0, 0]
            if m.kind == "evict":
                c[2] += 1
                start = self.since.pop(key, None)
                if start is not None:
                    self.device_ns[key] = self.device_ns.get(key, 0) + ts - start
                continue
            c[0 if m.kind == "fetch" else 1] += 1
            self.since.setdefault(key, ts)
            self.copied_bytes += m.bytes
            if m.kind == "fetch":
                self.demand_bytes += m.bytes
            if m.ns:
                self.copy_ns += m.ns
                self.timed_bytes += m.bytes
        self.series_ts.append(ts)
        self.series_bytes.append(self.device_bytes)

    def restarted(self, ts: int) -> None:
        for key, start in self.since.items():
            self.device_ns[key] = self.device_ns.get(key, 0) + ts - start
        self.since.clear()
        self.series_ts.append(ts)
        self.series_bytes.append(0)

    def device_share(self, key: tuple[int, int], at_ns: int) -> float | None:
        """Fraction of the span the ledger covers that the expert spent on the device."""
        if self.first_ts is None or at_ns <= self.first_ts:
            return None
        t = self.device_ns.get(key, 0) + (at_ns - self.since[key] if key in self.since else 0)
        return t / (at_ns - self.first_ts)


class ExpertLedger:
    """Observer: the experts of every worker (``workers``), in one pass with anything else."""

    def __init__(self, acct: Accounting | None = None, params: DiagnoseParams | None = None) -> None:
        self.workers: dict[int, WorkerExperts] = {}

    def handlers(self):
        return {ExpertsMoved: self._moved, WorkerJoined: self._joined}

    def _moved(self, rec: Recorded) -> None:
        e: ExpertsMoved = rec.event
        w = self.workers.get(e.worker)
        if w is None:
            w = self.workers[e.worker] = WorkerExperts(e.worker)
        w.moved(rec.envelope.ts_ns, e)

    def _joined(self, rec: Recorded) -> None:
        w = self.workers.get(rec.event.worker)
        if w is not None:
            w.restarted(rec.envelope.ts_ns)


def _name(key: tuple[int, int]) -> str:
    return f"L{key[0]}/E{key[1]}"


class ExpertThrash:
    """An expert fetched and evicted ``expert_thrash_cycles`` times within ``expert_thrash_window_ns``:
    its device slot is worth less than the copies that keep refilling it. Every such expert of one
    worker, with marked cycles closer than the window, is one episode; the proof is the seqs of the
    ``ExpertsMoved`` events whose fetches and evictions made the cycles."""

    name = "expert_thrash"

    def __init__(self, acct: Accounting, params: DiagnoseParams) -> None:
        self.need = params.expert_thrash_cycles
        self.window = params.expert_thrash_window_ns
        self.fetched: dict[int, dict[tuple[int, int], int]] = {}        # worker -> expert -> seq of its last copy in
        self.cycles: dict[int, dict[tuple[int, int], list]] = {}        # worker -> expert -> [ts, seq_in, seq_out, ...]
        self.open: dict[int, dict] = {}
        self.done: list[dict] = []

    def handlers(self):
        return {ExpertsMoved: self._moved, WorkerJoined: self._joined}

    def _joined(self, rec: Recorded) -> None:
        self.fetched.pop(rec.event.worker, None)

    def _moved(self, rec: Recorded) -> None:
        e: ExpertsMoved = rec.event
        ts, seq = rec.envelope.ts_ns, rec.envelope.seq
        fetched = self.fetched.setdefault(e.worker, {})
        cycles = self.cycles.setdefault(e.worker, {})
        for m in e.moves:
            key = (m.layer, m.expert)
            if m.kind != "evict":
                fetched[key] = seq
                continue
            seq_in = fetched.pop(key, None)
            if seq_in is None:
                continue            # evicted without a copy in this ledger (its placement came before)
            c = cycles.setdefault(key, [])
            c += (ts, seq_in, seq)
            while c and c[0] < ts - self.window:
                del c[:3]
            if len(c) >= 3 * self.need:
                self._mark(e.worker, key, ts, c, m.bytes)

    def _mark(self, worker: int, key: tuple[int, int], ts: int, c: list, nbytes: int) -> None:
        ep = self.open.get(worker)
        if ep is not None and ts - ep["last_ts"] > self.window:
            self.done.append(self.open.pop(worker))
            ep = None
        if ep is None:
            ep = self.open[worker] = {"worker": worker, "onset_ns": c[0], "last_ts": ts, "experts": {},
                                      "seqs": [], "cycles": 0, "bytes": 0}
        ep["last_ts"] = ts
        ep["experts"][key] = ep["experts"].get(key, 0) + 1
        ep["cycles"] += 1
        ep["bytes"] += nbytes
        if len(ep["seqs"]) < 64:
            ep["seqs"] += [c[i] for i in range(len(c)) if i % 3]

    def finish(self, at_ns: int) -> list[Finding]:
        out = []
        for ep in self.done + list(self.open.values()):
            until = ep["last_ts"] if at_ns - ep["last_ts"] > self.window else None
            worst = sorted(ep["experts"], key=lambda k: (-ep["experts"][k], k))
            out.append(Finding(
                detector=self.name, severity="warning",
                title=(f"worker {ep['worker']}: {len(worst)} experts fetched and evicted {self.need}+ times within "
                       f"{fmt_duration(self.window)} ({ep['cycles']} such cycles, {fmt_bytes(ep['bytes'])} re-copied)"),
                seqs=proof(ep["seqs"]), subject=f"worker {ep['worker']} experts",
                onset_ns=ep["onset_ns"], until_ns=until,
                suggestion=("the experts this traffic needs do not fit their device slots: raise --expert-budget, "
                            "or serve fewer sequences at once (each one spreads the routing further)"),
                detail={"experts": [_name(k) for k in worst[:16]], "cycles": ep["cycles"], "bytes": ep["bytes"],
                        "worker": ep["worker"]},
            ))
        return out


__all__ = ["ExpertLedger", "ExpertThrash", "WorkerExperts"]
