"""What /metrics reads about serving: moves counted by kind and outcome as the ledger records them
(an offloaded MoE model's expert moves too), and a snapshot of the folded state and the request
table taken on the loop thread.

A restore the worker timed also teaches the cost model its bandwidth (``CostModel.observe_transfer``):
the terminal event is the one place that knows both the move's source tier and its duration.
"""
from __future__ import annotations

import collections

from residency.control.scheduler.asker import TERMINAL
from residency.control.scheduler.cost import CostModel
from residency.control.scheduler.port import BackendStats
from residency.control.scheduler.requests import RequestTable
from residency.control.scheduler.router import Router
from residency.control.scheduler.sessions import tier_of
from residency.control.scheduler.workers import ServingWorkers
from residency.events import catalog as ev


class ServingStats:
    def __init__(self, proc, cost: CostModel, workers: ServingWorkers, requests: RequestTable, router: Router,
                 restores: collections.Counter | None = None):
        self.proc = proc
        self.cost = cost
        self.workers = workers
        self.requests = requests
        self.router = router
        self.moves: collections.Counter = collections.Counter()     # (kind, outcome)
        self.disk_bytes_kept = 0          # WorkerLost.bytes_kept recorded by this process
        self._kind_of: dict[str, str] = {}
        self._src_of: dict[str, str] = {}                          # restore move -> source tier
        self.restores = restores if restores is not None else collections.Counter()   # Admission's: by path
        self.steps: collections.Counter = collections.Counter()     # StepCompleted by decode path
        self.restore_wait_ns = 0          # StepCompleted.restore_wait_ns summed (the steps that said one)
        self.num_restore_waits = 0
        self.expert_moves: collections.Counter = collections.Counter()     # ExpertMove by kind
        self.expert_fetched_bytes = 0
        self.expert_served_bytes: collections.Counter = collections.Counter()   # device | fetched

    def observe(self, event: ev.Event) -> None:
        """Every event the control process records, on its loop thread."""
        t = type(event)
        if t is ev.MoveRequested:
            self._kind_of[event.move_id] = event.kind
            if event.kind == "restore":
                self._src_of[event.move_id] = event.src
        elif t in TERMINAL or t is ev.CopiesReleased:
            kind = self._kind_of.get(event.move_id, "unknown")
            self.moves[(kind, t.__name__)] += 1
            if t is not ev.MoveStranded:        # a stranded move may still end: keep what it was
                self._kind_of.pop(event.move_id, None)
                src = self._src_of.pop(event.move_id, None)
                if src is not None and t is ev.MoveAcked:
                    self.cost.observe_transfer(src, event.bytes_moved, (event.finished_ns - event.started_ns) / 1e9)
        elif t is ev.StepCompleted:
            self.steps[event.decode_path or "unsaid"] += 1
            if event.restore_wait_ns is not None:
                self.restore_wait_ns += event.restore_wait_ns
                self.num_restore_waits += 1
        elif t is ev.WorkerLost:
            self.disk_bytes_kept += event.bytes_kept
        elif t is ev.ExpertsMoved:
            for m in event.moves:
                self.expert_moves[m.kind] += 1
            self.expert_fetched_bytes += event.fetched_bytes
            self.expert_served_bytes["device"] += event.served_device_bytes
            self.expert_served_bytes["fetched"] += event.served_fetched_bytes

    def expert_fields(self) -> dict:
        """The experts' part of ``BackendStats`` (copies: the counters go on counting)."""
        return dict(expert_moves=dict(self.expert_moves), expert_fetched_bytes=self.expert_fetched_bytes,
                    expert_served_bytes=dict(self.expert_served_bytes))

    def collect(self, draining: bool) -> BackendStats:
        """Loop thread only (``proc.call``): the state is consistent there."""
        st = self.proc.state
        used, cap = {}, {}
        for w, ws in st.workers.items():
            for t, acc in ws.tiers.items():
                used[(str(w), t)] = acc.used_bytes
                cap[(str(w), t)] = acc.capacity_bytes
        by_tier: collections.Counter = collections.Counter()
        sched = self.workers.sched
        if sched is not None:
            for e in sched.sessions.values():
                pages = [b for b in e.blocks if b in st.blocks.get(e.worker, {})]
                by_tier[tier_of(st, e.worker, pages) or "none"] += 1
        h = self.proc.health()
        lag_ms = h.metrics.get("commit_lag_ms")
        return BackendStats(
            tier_used_bytes=used, tier_capacity_bytes=cap, moves=dict(self.moves),
            stranded_bytes=st.stranded_bytes_total(),
            ledger_append_lag_s=None if lag_ms is None else lag_ms / 1e3, ledger_last_seq=st.last_seq,
            running_requests=self.requests.num_running(),
            waiting_requests=len(self.requests.waiting), sessions_by_tier=dict(by_tier),
            restore_decisions=dict(sched.decisions) if sched is not None else {}, routed=dict(self.router.routed),
            draining=draining, disk_bytes_kept=self.disk_bytes_kept,
            disk_bytes_dropped=self.proc.metrics.get("disk_bytes_dropped", 0),
            steps_by_path=dict(self.steps), restores_by_path=dict(self.restores),
            restore_wait_s=self.restore_wait_ns / 1e9, num_restore_waits=self.num_restore_waits,
            **self.expert_fields(),
        )
