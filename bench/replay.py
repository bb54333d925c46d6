"""Replay bench: decode + fold of a simulated ledger from zero, and `replay --at` with snapshots.

Targets (issue 2): replay from zero >= 300k events/s; `replay --at` the last seq with
snapshots <= 2 s. Prints a table; writes bench/results/replay-<date>-<machine>.json.

    python bench/replay.py [--events 1000000] [--db sqlite:////tmp/replay-bench.db] [--machine cpu] [--repeat 5]

Replay from zero is the best of --repeat runs, every run is in the JSON (and its spread in the
table): this is a shared 2-core VM whose speed swings by tens of percent from minute to minute.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path


from residency.control.replay import replay, write_snapshots  # noqa: E402
from residency.control.simulate import simulate  # noqa: E402
from residency.ledger import LedgerStore  # noqa: E402

from commit import git_commit  # noqa: E402  (bench/commit.py)


def _load_1m() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--db", default="sqlite:////tmp/residency-replay-bench.db")
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--snapshot-every", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.db.startswith("sqlite:///"):
        for suffix in ("", "-wal", "-shm"):
            p = args.db[len("sqlite:///"):] + suffix
            if os.path.exists(p):
                os.remove(p)
    results: dict = {"bench": "replay", "date": dt.date.today().isoformat(), "machine": args.machine,
                     "commit": git_commit(), "events": args.events, "db": args.db.split("://")[0]}
    with LedgerStore.open(args.db, create=True) as store:
        t = time.perf_counter()
        batch = []
        for item in simulate(args.events, seed=7):
            batch.append(item)
            if len(batch) == 10_000:
                store.append(batch, durability="normal")
                batch = []
        if batch:
            store.append(batch, durability="normal")
        results["simulate_and_append_s"] = time.perf_counter() - t

        runs, loads = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            state, snap = replay(store, use_snapshots=False)
            runs.append(time.perf_counter() - t)
            loads.append(_load_1m())
        results["replay_from_zero_s"] = min(runs)
        results["replay_from_zero_events_per_s"] = args.events / min(runs)
        results["replay_from_zero_samples_s"] = runs
        results["replay_from_zero_events_per_s_median"] = args.events / sorted(runs)[len(runs) // 2]
        # the 1-minute load after each run (this replay's own two threads count in it too)
        results["load_average_1m_after_each_run"] = loads
        results["load_average_1m_at_end"] = loads[-1] if loads else None
        results["replay_state_hash"] = state.state_hash()

        t = time.perf_counter()
        saved = write_snapshots(store, args.snapshot_every)
        results["write_snapshots_s"] = time.perf_counter() - t
        results["snapshots"] = saved

        for label, at in (("last", args.events), ("mid_after_snapshot", args.events - args.snapshot_every // 2)):
            t = time.perf_counter()
            st, snap = replay(store, at)
            results[f"replay_at_{label}_with_snapshots_s"] = time.perf_counter() - t
            results[f"replay_at_{label}_snapshot_seq"] = snap
        assert st is not None
        state_at_last, _ = replay(store, args.events)
        results["snapshot_replay_matches_zero_replay"] = state_at_last.state_hash() == results["replay_state_hash"]

    rows = [
        ("events", f"{args.events:,}", ""),
        ("replay from zero (decode+fold), best", f"{results['replay_from_zero_events_per_s']:,.0f} ev/s", ">= 300,000"),
        (f"  median / worst of {len(runs)}", f"{results['replay_from_zero_events_per_s_median']:,.0f} / "
                                         f"{args.events / max(runs):,.0f}", ""),
        ("  1-min load after each run", " ".join(f"{x:.1f}" for x in loads if x is not None), ""),
        ("replay --at last, with snapshots", f"{results['replay_at_last_with_snapshots_s']:.3f} s", "<= 2 s"),
        ("replay --at mid, from snapshot", f"{results['replay_at_mid_after_snapshot_with_snapshots_s']:.3f} s", ""),
        ("snapshot == zero replay", str(results["snapshot_replay_matches_zero_replay"]), "True"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'value':>22}  target")
    for name, val, target in rows:
        print(f"{name:<{w}}  {val:>22}  {target}")
    out = Path(__file__).parent / "results" / f"replay-{results['date']}-{args.machine}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
