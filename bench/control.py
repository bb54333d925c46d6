"""Control-plane bench: what commanding a move through the control process costs.

    round trip   one one-block move, as a caller of the control process sees it:
                 submit -> MoveRequested committed -> ExecuteMove -> worker -> MoveAcked -> committed
                 -> answer. p50/p90/p99 on SQLite and PostgreSQL. Target: p50 <= 1 ms on SQLite.
    sustained    one-block moves per second the control process commands with many in flight.
                 Target: >= 5,000/s.
    spill        (--spill-bytes; meant for --device cuda, e.g. 2 GiB on an H200) one large spill
                 device->host run by the engine in this process, then the same spill through the
                 control process and a worker: the difference is what the control plane adds.
                 Each traced move also gives a breakdown (``PHASES``: the control's marks, the
                 worker's MoveTimed, the ack's times) and the overhead against the worker's own
                 engine call, measured in the same run for the same move.
    control only (with --spill-bytes) the same number of 2 MiB blocks moved by a no-copy worker,
                 many times: the control plane's cost of a big move without a copy's noise.

Each figure is measured twice over: with the worker's real engine (copies and checksums on this
device), and with ``--engine nocopy`` workers that keep block tables and move no bytes, which
isolates the control plane (ledger commits, ZMQ, the worker's process shell). The machine is a
shared 2-core VM: each figure is the best of --repeat runs, all runs and the load average are in
the JSON. Prints a table; writes bench/results/control-<date>-<device>.json.

    python bench/control.py [--moves 2000] [--pg postgresql+psycopg://root@127.0.0.1:5432/test]
    python bench/control.py --device cuda --spill-bytes 2GiB
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from residency.control.cli.ctl_cmd import parse_size  # noqa: E402
from control_cluster import BIG_LAYOUT, SMALL_LAYOUT, Cluster, git_commit, layout_bytes, pct  # noqa: E402
from control_spill import (  # noqa: E402
    VARIANTS, cpu_spinner, default_variant, dma_hog, spill, spill_control_only, under_dma_load,
)
from residency.events.asks import AskMove  # noqa: E402
from residency.control.logconfig import configure_logging  # noqa: E402





def round_trip(c: Cluster, n: int) -> dict:
    (b,) = c.commit(1)
    lat = []
    for i in range(n + 50):
        kind = "evict" if i % 2 == 0 else "restore"
        t0 = time.perf_counter()
        ans = c.proc.submit(AskMove(ask_id="rt", kind=kind, worker=0, blocks=[b])).result(60)
        dt_ = time.perf_counter() - t0
        if ans.error or type(ans.events[0]).__name__ != "MoveAcked":
            raise RuntimeError(f"round trip {i}: {ans}")
        if i >= 50:
            lat.append(dt_)
    return {"n": n, "p50_ms": pct(lat, 0.5) * 1e3, "p90_ms": pct(lat, 0.9) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "mean_ms": sum(lat) / len(lat) * 1e3}


def sustained(c: Cluster, n: int, chunk: int = 512) -> dict:
    """One-block moves, two chunks in flight (each chunk's blocks move while the other's commit)."""
    sets = [c.commit(chunk), c.commit(chunk)]
    where = ["device", "device"]
    done = 0
    inflight = None
    t0 = time.perf_counter()
    k = 0
    while done < n:
        s = k % 2
        kind = "evict" if where[s] == "device" else "restore"
        futs = c.proc.submit_many([AskMove(ask_id="s", kind=kind, worker=0, blocks=[b]) for b in sets[s]])
        where[s] = "host" if kind == "evict" else "device"
        if inflight is not None:
            done += _settled(inflight)
        inflight = futs
        k += 1
    done += _settled(inflight)
    dt_ = time.perf_counter() - t0
    return {"moves": done, "seconds": dt_, "moves_per_s": done / dt_, "in_flight": 2 * chunk}


def _settled(futs) -> int:
    for f in futs:
        ans = f.result(120)
        if ans.error or type(ans.events[0]).__name__ != "MoveAcked":
            raise RuntimeError(f"sustained: {ans}")
    return len(futs)








def pg_url(base: str):
    from sqlalchemy import create_engine, text  # noqa: PLC0415
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)

    def drop():
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return url, drop


# The targets: a one-block round trip (control plane alone, SQLite, durability normal), small
# moves sustained (the same), and the control's overhead on a 2 GiB spill over the engine called in
# process (GPU), as a fraction of the in-process median: paired (each spill's wall less its own
# engine call, median) and unpaired (median through the control less median in process).
TARGETS = {"round_trip_p50_ms_sqlite": 1.0, "sustained_moves_per_s": 5000, "spill_overhead_fraction": 0.02}


def judge(results: dict) -> dict:
    """Each target this run measured: {target, measured, met} (the spill's by its headline variant)."""
    out = {}
    mine = ("sqlite", "nocopy", "normal")
    rt = [r["p50_ms"] for r in results["round_trip"] if (r["backend"], r["engine"], r["durability"]) == mine]
    if rt:
        best = min(rt)
        out["round_trip_p50_ms_sqlite"] = ("round_trip_p50_ms_sqlite", best, best <= TARGETS["round_trip_p50_ms_sqlite"])
    su = [r["moves_per_s"] for r in results["sustained"] if (r["backend"], r["engine"], r["durability"]) == mine]
    if su:
        out["sustained_moves_per_s"] = ("sustained_moves_per_s", max(su), max(su) >= TARGETS["sustained_moves_per_s"])
    s = results.get("spill")
    if s and s.get("in_process_p50_s") and s.get("control_overhead_vs_engine_call_p50_s") is not None:
        for key, field in (("spill_overhead_fraction_paired", "control_overhead_vs_engine_call_p50_s"),
                           ("spill_overhead_fraction_unpaired", "control_overhead_p50_vs_in_process_p50_s")):
            frac = s[field] / s["in_process_p50_s"]
            out[key] = ("spill_overhead_fraction", frac, frac <= TARGETS["spill_overhead_fraction"])
    return {k: {"target": TARGETS[t], "measured": round(m, 4), "met": bool(ok)} for k, (t, m, ok) in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--moves", type=int, default=2000, help="round trips measured per configuration")
    ap.add_argument("--sustained", type=int, default=20000, help="moves in each sustained run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pg", default=os.environ.get("RESIDENCY_BENCH_PG_URL") or os.environ.get("RESIDENCY_TEST_PG_URL"))
    ap.add_argument("--engines", default="nocopy,real")
    ap.add_argument("--spill-bytes", type=parse_size, default=0, help="e.g. 2GiB (on --device cuda); 0 = skip")
    ap.add_argument("--spill-reps", type=int, default=None,
                    help="moves of the spill through the control process (evict, restore, evict, ...); "
                         "default 9 on cuda (the breakdown is the median of 5 spills), 3 on cpu (17 s each)")
    ap.add_argument("--control-only-reps", type=int, default=60,
                    help="1024-block moves through a no-copy worker (half evict, half restore)")
    ap.add_argument("--spill-variants", default=None,
                    help=f"comma-separated, of {','.join(VARIANTS)}; default: all on cuda, the default on cpu")
    ap.add_argument("--dma-load", action="store_true",
                    help="(cuda) run the control-only moves a second time while another process streams "
                         "2 GiB copies between the GPU and pinned host memory")
    ap.add_argument("--dma-hog", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu-spinner", action="store_true",
                    help="keep one CPU busy in another process through the spill section (what an idle host costs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dma_hog is not None:
        dma_hog(args.dma_hog)
        return 0
    if args.spill_reps is None:
        args.spill_reps = 9 if args.device.startswith("cuda") else 3
    configure_logging(level="warning")
    os.environ.setdefault("RESIDENCY_WORKER_LOG_LEVEL", "warning")
    tmp = Path(tempfile.mkdtemp(prefix="rcb-db-"))
    backends = [("sqlite", lambda: (f"sqlite:///{tmp / uuid.uuid4().hex}.db", lambda: None))]
    if args.pg:
        backends.append(("postgresql", lambda: pg_url(args.pg)))
    results: dict = {"round_trip": [], "sustained": [], "spill": None, "spill_control_only": None}
    load_before = os.getloadavg()
    rows = []
    for engine in args.engines.split(","):
        for backend, make in backends:
            for durability in (("normal", "full") if backend == "sqlite" and engine == "nocopy" else ("normal",)):
                runs_rt, runs_s = [], []
                for _ in range(args.repeat):
                    url, drop = make()
                    c = Cluster(url, engine, args.device, SMALL_LAYOUT, 4096, 4096 * 16384, durability)
                    try:
                        runs_rt.append(round_trip(c, args.moves))
                        if durability == "normal":
                            runs_s.append(sustained(c, args.sustained))
                    finally:
                        c.close()
                        drop()
                best = min(runs_rt, key=lambda r: r["p50_ms"])
                cfg = {"engine": engine, "backend": backend, "durability": durability, "device": args.device}
                results["round_trip"].append({**cfg, **best, "runs": runs_rt})
                line = (f"{engine:7s} {backend:10s} {durability:7s} round trip p50 {best['p50_ms']:6.3f} ms  "
                        f"p90 {best['p90_ms']:6.3f}  p99 {best['p99_ms']:6.3f}")
                if runs_s:
                    bs = max(runs_s, key=lambda r: r["moves_per_s"])
                    results["sustained"].append({**cfg, **bs, "runs": runs_s})
                    line += f"   sustained {bs['moves_per_s']:7.0f} moves/s"
                rows.append(line)
                print(line, flush=True)
    if args.spill_bytes:
        url, drop = backends[0][1]()
        try:
            results["spill_control_only"] = co = spill_control_only(
                url, max(1, args.spill_bytes // layout_bytes(BIG_LAYOUT)), args.control_only_reps)
        finally:
            drop()
        if args.dma_load:
            url, drop = backends[0][1]()
            try:
                results["spill_control_only_under_dma_load"] = under_dma_load(lambda: spill_control_only(
                    url, max(1, args.spill_bytes // layout_bytes(BIG_LAYOUT)), args.control_only_reps))
            finally:
                drop()
            u = results["spill_control_only_under_dma_load"]["evict"]
            line = (f"control only, evict, under a DMA load: overhead min {u['overhead_vs_engine_call_ms']['min']:.3f} ms"
                    f"  p50 {u['overhead_vs_engine_call_ms']['p50']:.3f}; phase medians: " + "; ".join(
                        f"{k} {v:.3f}" for k, v in (u["breakdown_ms_phase_medians"] or {}).items()
                        if not k.startswith("engine: measured")))
            rows.append(line)
            print(line, flush=True)
        for kind in ("evict", "restore"):
            o = co[kind]["overhead_vs_engine_call_ms"]
            line = (f"control only, {co['blocks']} blocks {kind:7s} (nocopy worker, {co['moves_per_kind']} moves): "
                    f"control overhead min {o['min']:.3f} ms  p50 {o['p50']:.3f}  p90 {o['p90']:.3f}")
            rows.append(line)
            print(line, flush=True)
        line = ("control only, evict breakdown ms (phase medians): " + "; ".join(
            f"{k} {v:.3f}" for k, v in (co["evict"]["breakdown_ms_phase_medians"] or {}).items()
            if not k.startswith("engine: measured")))
        rows.append(line)
        print(line, flush=True)
        url, drop = backends[0][1]()
        spinner = None
        try:
            variants = (args.spill_variants.split(",") if args.spill_variants
                        else list(VARIANTS) if args.device.startswith("cuda") else None)
            spinner = cpu_spinner() if args.cpu_spinner else None
            results["spill"] = spill(url, args.device, args.spill_bytes, args.spill_reps, variants)
            results["spill"]["cpu_spinner"] = spinner is not None
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait(10)
            drop()
        s = results["spill"]
        bd = s.get("breakdown_ms_phase_medians")
        if bd:      # one line, before the headline (gpu_session.sh keeps the tail)
            line = (f"spill breakdown ms (median of {(args.spill_reps + 1) // 2} spills): "
                    + "; ".join(f"{k} {v:.3f}" for k, v in bd.items() if not k.startswith("engine: measured")))
            rows.append(line)
            print(line)
        vs_engine = s["control_overhead_vs_engine_call_s"]
        line = (f"spill {s['bytes'] / 2**30:.2f} GiB {args.device}: in process {s['in_process_s'] * 1e3:.1f} ms "
                f"({s['in_process_gb_s']:.1f} GB/s), through control {s['through_control_s'] * 1e3:.1f} ms "
                f"({s['through_control_gb_s']:.1f} GB/s; worker measured {s['worker_measured_s'] * 1e3:.1f} ms), "
                f"control overhead {s['control_overhead_s'] * 1e3:.1f} ms vs in process, "
                f"{s['control_overhead_vs_worker_s'] * 1e3:.1f} ms vs the worker's own time"
                + (f", {vs_engine * 1e3:.2f} ms vs the worker's engine call (best; p50 "
                   f"{s['control_overhead_vs_engine_call_p50_s'] * 1e3:.2f})" if vs_engine is not None else ""))
        rows.append(line)
        print(line)
        for name, v in s["variants"].items():
            vs = v["control_overhead_vs_engine_call_all_s"]
            line = (f"spill through control, {name:12s}: overhead vs the engine call min {min(vs) * 1e3:.3f} ms  "
                    f"p50 {v['control_overhead_vs_engine_call_p50_s'] * 1e3:.3f}  ({len(vs)} spills); "
                    f"p50 through control - p50 in process {v['control_overhead_p50_vs_in_process_p50_s'] * 1e3:.3f} ms"
                    + ("  <- headline" if name == s["headline_variant"] else "")
                    + ("  (this host's default)" if name == default_variant() else ""))
            rows.append(line)
            print(line)
    shutil.rmtree(tmp, ignore_errors=True)
    verdicts = judge(results)
    for name, v in verdicts.items():
        line = f"target {name}: {v['measured']} (target {v['target']}) {'met' if v['met'] else 'MISSED'}"
        rows.append(line)
        print(line)
    doc = {
        "bench": "control", "date": dt.date.today().isoformat(), "git_commit": git_commit(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "device": args.device},
        "targets": TARGETS, "verdicts": verdicts,
        "notes": ("round trip = submit() -> MoveRequested committed -> worker -> MoveAcked committed -> answer, "
                  "as the in-process API sees it; nocopy workers move no bytes (control plane alone), real workers "
                  "run the engine (copy + checksum). Best of --repeat runs; all runs kept."),
        "table": rows, **results,
    }
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"control-{doc['date']}-{'cpu' if args.device == 'cpu' else args.device.replace(':', '')}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
