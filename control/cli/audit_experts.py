"""`residency audit experts`: where an offloaded MoE model's experts lived, from the ledger.

Per worker: the experts' bytes on each tier (every expert keeps its host copy; the device holds
those in slots), how much of the routed expert bytes the device served without a fetch, what was
copied and how long the copies measured, the device bytes over time, and per expert its fetches,
prefetches, evictions, share of time on the device and tier now. The fetch-vs-wait price of the
demand fetches comes from the control's own cost model, taught the same measured copies.
"""
from __future__ import annotations

from residency.control.diagnose.experts import ExpertLedger, WorkerExperts
from residency.control.diagnose.scan import run_pass
from residency.control.scheduler.cost import CostModel
from residency.control.views import human_bytes, iso
from residency.events import ExpertsMoved

NUM_POINTS = 12          # device bytes over time: this many instants, evenly spread


def collect(events, since_ns: int | None = None, until_ns: int | None = None) -> tuple[ExpertLedger, CostModel]:
    """The experts of every worker, and a cost model that observed their measured copies."""
    led, cost = ExpertLedger(), CostModel()

    class _Cost:
        def handlers(self):
            return {ExpertsMoved: lambda rec: cost.observe_expert_moves(rec.event.moves)}

    def cut():
        for rec in events:
            ts = rec.envelope.ts_ns
            if until_ns is not None and ts > until_ns:
                return
            if since_ns is None or ts >= since_ns:
                yield rec

    run_pass(cut(), [led, _Cost()])
    return led, cost


def series_points(w: WorkerExperts, n: int = NUM_POINTS) -> list[tuple[int, int]]:
    """(ts, device expert bytes) at ``n`` instants from the first to the last event."""
    if not w.series_ts:
        return []
    t0, t1 = w.series_ts[0], w.series_ts[-1]
    out, i = [], 0
    for k in range(n):
        t = t0 + (t1 - t0) * k // max(1, n - 1)
        while i + 1 < len(w.series_ts) and w.series_ts[i + 1] <= t:
            i += 1
        out.append((t, w.series_bytes[i]))
    return out


def summary(w: WorkerExperts, cost: CostModel, at_ns: int, limit: int) -> dict:
    served = w.served_device_bytes + w.served_fetched_bytes
    experts = []
    for key, (fetches, prefetches, evictions) in w.counts.items():
        experts.append({"layer": key[0], "expert": key[1], "fetches": fetches, "prefetches": prefetches,
                        "evictions": evictions, "tier_now": "device+host" if key in w.since else "host",
                        "device_share": w.device_share(key, at_ns)})
    experts.sort(key=lambda r: (-(r["fetches"] + r["prefetches"]), r["layer"], r["expert"]))
    price = cost.price_expert_fetch(w.demand_bytes)
    return {
        "worker": w.worker, "num_layers": w.num_layers, "num_experts": w.num_experts, "expert_bytes": w.expert_bytes,
        "tiers": {"host": w.host_bytes, "device": w.device_bytes},
        "served_device_bytes": w.served_device_bytes, "served_fetched_bytes": w.served_fetched_bytes,
        "served_from_device": w.served_device_bytes / served if served else None,
        "copied_bytes": w.copied_bytes, "demand_fetch_bytes": w.demand_bytes,
        "measured_copy_s": w.copy_ns / 1e9 if w.timed_bytes else None,
        "measured_gbs": w.timed_bytes / w.copy_ns if w.copy_ns else None,
        "demand_fetch_wait_s_priced": price.wait_s,
        "num_events": w.num_events,
        "device_bytes_over_time": [{"ts_ns": t, "device_bytes": b} for t, b in series_points(w)],
        "experts": experts[:limit], "num_experts_moved": len(experts),
    }


NO_EXPERTS = "no expert moved: no worker serves an offloaded MoE model in this ledger (serve --expert-budget)"


def expert_rows(store, since_ns: int | None, until_ns: int | None, limit: int) -> list[dict]:
    """A ``summary`` per worker that moved experts in [since, until], by worker."""
    led, cost = collect(store.read(1, store.last_seq()), since_ns, until_ns)
    rows = []
    for w in sorted(led.workers.values(), key=lambda w: w.worker):
        at = w.last_ts if until_ns is None else min(until_ns, max(w.last_ts, until_ns))
        rows.append(summary(w, cost, at, limit))
    return rows


def print_experts(rows: list[dict]) -> None:
    for r in rows:
        eb = r["expert_bytes"]
        frac = r["served_from_device"]
        print(f"worker {r['worker']}: {r['num_layers']} layers x {r['num_experts']} experts of {human_bytes(eb)}")
        print(f"  host   {human_bytes(r['tiers']['host']):>12}  every expert")
        print(f"  device {human_bytes(r['tiers']['device']):>12}  {r['tiers']['device'] // eb if eb else 0} experts in slots now")
        print(f"  served from the device: {'-' if frac is None else f'{frac:.1%}'} of "
              f"{human_bytes(r['served_device_bytes'] + r['served_fetched_bytes'])} routed")
        gbs = r["measured_gbs"]
        print(f"  copied onto the device: {human_bytes(r['copied_bytes'])} ({human_bytes(r['demand_fetch_bytes'])} on demand)"
              f", measured {'-' if gbs is None else f'{gbs:.2f} GB/s'}; demand fetches priced at "
              f"{r['demand_fetch_wait_s_priced'] * 1e3:.1f} ms of waiting")
        print("  device expert bytes over time:")
        for p in r["device_bytes_over_time"]:
            print(f"    {iso(p['ts_ns'])}  {human_bytes(p['device_bytes']):>12}")
        print(f"  experts moved most ({len(r['experts'])} of {r['num_experts_moved']}):")
        print(f"    {'layer':>5} {'expert':>6} {'fetches':>8} {'prefetch':>8} {'evicted':>8} {'on device':>9}  tier now")
        for x in r["experts"]:
            share = "-" if x["device_share"] is None else f"{x['device_share']:.0%}"
            print(f"    {x['layer']:>5} {x['expert']:>6} {x['fetches']:>8} {x['prefetches']:>8} {x['evictions']:>8} "
                  f"{share:>9}  {x['tier_now']}")


__all__ = ["NO_EXPERTS", "collect", "expert_rows", "print_experts", "summary", "series_points"]
