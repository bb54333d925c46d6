"""What /metrics reads from the control process, collected on its loop thread."""
from __future__ import annotations

import collections

from residency.control.api.backend import BackendStats
from residency.control.scheduler.sessions import tier_of


def collect_stats(svc) -> BackendStats:
    """``svc``: a ServingService. Loop thread only (``proc.call``)."""
    st = svc.proc.state
    used, cap = {}, {}
    for w, ws in st.workers.items():
        for t, acc in ws.tiers.items():
            used[(str(w), t)] = acc.used_bytes
            cap[(str(w), t)] = acc.capacity_bytes
    by_tier: collections.Counter = collections.Counter()
    if svc.sched is not None:
        for e in svc.sched.sessions.values():
            by_tier[tier_of(st, e.worker, [b for b in e.blocks if b in st.blocks.get(e.worker, {})]) or "none"] += 1
    h = svc.proc.health()
    lag_ms = h.metrics.get("commit_lag_ms")
    return BackendStats(
        tier_used_bytes=used, tier_capacity_bytes=cap, moves=dict(svc.moves),
        stranded_bytes=st.stranded_bytes_total(),
        ledger_append_lag_s=None if lag_ms is None else lag_ms / 1e3, ledger_last_seq=st.last_seq,
        running_requests=sum(1 for p in svc.pending.values() if p.phase == "running"),
        waiting_requests=len(svc.waiting), sessions_by_tier=dict(by_tier),
        restore_decisions=dict(svc.sched.decisions) if svc.sched else {}, routed=dict(svc.routed),
        draining=svc.draining, disk_bytes_kept=svc.disk_bytes_kept,
        disk_bytes_dropped=svc.proc.metrics.get("disk_bytes_dropped", 0),
    )
