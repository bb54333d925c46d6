"""Diagnose/report bench: `residency diagnose` and `residency report` on a 1,000,000-event ledger.

Target (issue 6): each finishes in under 30 s on the 2-core CPU machine. The ledger is the
simulator's (every kind of event, faults included), ending in a wedge: a move that is never
acked while requests wait and the control plane keeps talking, so the detectors have something
to find at the end. The commands run as subprocesses, timed end to end (imports, reading and
decoding the ledger, the pass, rendering, writing); the machine is shared, so each runs
``--repeat`` times and the fastest is kept, with its CPU time and the load average beside it.

    python bench/diagnose.py [--events 1000000] [--db sqlite:////tmp/residency-diagnose-bench.db] [--reuse]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from residency.control.simulate import simulate  # noqa: E402
from residency.events import Envelope  # noqa: E402
from residency.events import catalog as ev  # noqa: E402
from residency.ledger import LedgerStore  # noqa: E402

from commit import git_commit  # noqa: E402  (bench/commit.py)

SECOND = 1_000_000_000


def wedge_tail(last: Envelope, n_seconds: int = 30):
    """A move the worker never answers, requests queued behind it, and 30 s of talk that is not progress."""
    seq, ts = last.producer_seq, last.ts_ns

    def env(dt_ns: int, corr: str | None = None) -> Envelope:
        nonlocal seq, ts
        seq += 1
        ts += dt_ns
        return Envelope(producer="bench", epoch=1, producer_seq=seq, ts_ns=ts, correlation_id=corr)

    out = [(env(1_000_000, "s-wedged"), ev.MoveRequested(
        move_id="m-wedged", kind="restore", worker=1, src="host", dst="device", blocks=[10**9, 10**9 + 1],
        bytes_planned=4 << 20, keep_source=True, deadline_ns=ts + 50_000_000, reason="turn", session="s-wedged"))]
    for i in range(5):
        out.append((env(1_000_000, f"req-w{i}"), ev.RequestAdmitted(request_id=f"req-w{i}", session="s-wedged",
                                                                   prompt_tokens=100 + i)))
    for i in range(n_seconds * 2):
        out.append((env(SECOND // 2), ev.MoveRefused(ask="policy:restore", worker=1, tier="device",
                                                     asked_bytes=4 << 20, available_bytes=0, floor_bytes=16 << 20,
                                                     reason="device below floor after restore")))
    return out


def build(db: str, events: int) -> float:
    path = db[len("sqlite:///"):] if db.startswith("sqlite:///") else None
    if path:
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
    t = time.perf_counter()
    with LedgerStore.open(db, create=True) as store:
        batch, last = [], None
        for item in simulate(events - 66, seed=11):
            batch.append(item)
            last = item[0]
            if len(batch) == 10_000:
                store.append(batch, durability="normal")
                batch = []
        batch += wedge_tail(last)
        store.append(batch, durability="normal")
    return time.perf_counter() - t


def timed(cmd: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return {"wall_s": round(wall, 2), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
            "max_rss_mib": round(after.ru_maxrss / 1024, 1), "stdout": proc.stdout}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--db", default="sqlite:////tmp/residency-diagnose-bench.db")
    ap.add_argument("--machine", default="cpu")
    ap.add_argument("--reuse", action="store_true", help="reuse the ledger at --db if it has --events events")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each command; the fastest is kept (others share the machine)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/diagnose-<date>-<machine>.json)")
    args = ap.parse_args()
    residency = str(Path(sys.executable).with_name("residency"))
    results: dict = {"bench": "diagnose", "date": dt.date.today().isoformat(), "machine": args.machine,
                     "cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
                     "python": platform.python_version(), "commit": git_commit(), "events": args.events,
                     "db": args.db.split("://")[0], "target_s": 30}
    have = 0
    if args.reuse:
        try:
            with LedgerStore.open(args.db) as store:
                have = store.last_seq()
        except Exception:
            have = 0
    if have != args.events:
        results["simulate_and_append_s"] = round(build(args.db, args.events), 1)

    with LedgerStore.open(args.db) as store:
        t = time.perf_counter()
        n = sum(1 for _ in store.read())
        results["read_and_decode_only_s"] = round(time.perf_counter() - t, 2)
        assert n == args.events, (n, args.events)

    results["load_avg_1m_before"] = round(os.getloadavg()[0], 2)
    d = min((timed([residency, "diagnose", "--db", args.db, "--json"]) for _ in range(args.repeat)),
            key=lambda x: x["wall_s"])
    found = json.loads(d.pop("stdout"))
    results["diagnose"] = d
    results["diagnose"]["num_findings"] = len(found["findings"])
    results["diagnose"]["by_severity"] = {s: sum(1 for f in found["findings"] if f["severity"] == s)
                                          for s in ("critical", "warning", "info")}
    results["diagnose"]["wedge_found"] = any(f["detector"] == "overdue_move" and "m-wedged" in f["title"]
                                             for f in found["findings"])
    results["diagnose"]["stall_found"] = any(f["detector"] == "stall" and f["until_ns"] is None
                                             for f in found["findings"])
    out_html = f"/tmp/residency-diagnose-bench-{os.getpid()}.html"
    r = min((timed([residency, "report", "--db", args.db, "-o", out_html]) for _ in range(args.repeat)),
            key=lambda x: x["wall_s"])
    r.pop("stdout")
    r["html_bytes"] = os.path.getsize(out_html)
    os.remove(out_html)
    results["report"] = r
    results["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    results["pass"] = results["diagnose"]["wall_s"] < 30 and results["report"]["wall_s"] < 30
    busy = max(results["load_avg_1m_before"], results["load_avg_1m_after"])
    if busy > (os.cpu_count() or 1):
        results["note"] = (f"the machine was shared (load average {busy:g} on {os.cpu_count()} cores): wall time "
                           f"stretches with the load; cpu_s is what the command itself needed")

    print(f"{args.events:,} events  read+decode only {results['read_and_decode_only_s']} s")
    for name in ("diagnose", "report"):
        x = results[name]
        print(f"  {name:<9} {x['wall_s']:>6} s wall  {x['cpu_s']:>6} s cpu  {x['max_rss_mib']:>7} MiB max RSS")
    print(f"  findings {results['diagnose']['by_severity']}  wedge found: {results['diagnose']['wedge_found']}  "
          f"stall found: {results['diagnose']['stall_found']}  report {results['report']['html_bytes'] / 1e6:.2f} MB")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"diagnose-{results['date']}-{args.machine}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
