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
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from control.cli.ctl_cmd import parse_size  # noqa: E402
from control.moves import MoveConfig  # noqa: E402
from control.policy import PolicyConfig  # noqa: E402
from control.proc import ControlConfig, ControlProc  # noqa: E402
from events import affinity  # noqa: E402
from events.commands import AskCommitBlocks, AskMove  # noqa: E402
from events.logconfig import configure_logging  # noqa: E402
from ledger import LedgerStore  # noqa: E402

SMALL_LAYOUT = "2,16,2,64,float16"          # 16 KiB blocks: a one-block move is latency, not bandwidth
BIG_LAYOUT = "32,16,8,128,bfloat16"         # 2 MiB blocks (Llama-8B-like pages): spills are bandwidth


def git_commit() -> str:
    try:
        rev = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=ROOT).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "control", "dataplane", "bench/control.py"],
                               cwd=ROOT).returncode != 0
        return rev + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Cluster:
    """A control process in this process, one worker process, one ledger."""

    def __init__(self, url: str, engine: str, device: str, layout: str, device_blocks: int, host_bytes: int,
                 durability: str = "normal", traced: bool = False, lane: bool = True,
                 cpus: tuple[int | None, int | None] = (None, None), nearly_done: bool = False,
                 ahead: bool = False):
        self.dir = Path(tempfile.mkdtemp(prefix="rcb-", dir="/tmp"))
        self.store = LedgerStore.open(url, create=True)
        cfg = ControlConfig(worker_endpoint=f"ipc://{self.dir}/w.sock", expected_workers=[0], release_on_stop=False,
                            durability=durability, policy=PolicyConfig(pressure=False, park=False),
                            moves=MoveConfig(deadline_base_s=60.0), checkpoint_every_events=10_000,
                            trace_moves=64 if traced else 0, cpu=cpus[0],
                            command_ahead_min_bytes=(64 << 20) if ahead else 0)
        self.proc = ControlProc(self.store, cfg).start()
        argv = [sys.executable, "-m", "dataplane.proc", "--worker", "0", "--control", cfg.worker_endpoint,
                "--run-dir", str(self.dir), "--engine", engine, "--device", device, "--kv-layout", layout,
                "--device-blocks", str(device_blocks), "--host-bytes", str(host_bytes), "--disk-bytes", "0",
                "--no-disk-fsync", "--model", "none"] + (["--report-timings"] if traced else []) + (
                    [] if lane else ["--no-lane"]) + (["--cpu", str(cpus[1])] if cpus[1] is not None else []) + (
                    ["--nearly-done"] if nearly_done else ["--no-nearly-done"]) + (
                    ["--awake-for-commands"] if ahead else ["--no-awake-for-commands"])
        if device == "cpu":
            argv += ["--torch-threads", "1"]
        self.worker = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while not self.proc.call(lambda p: 0 in p._by_worker).result(10):
            if time.monotonic() > deadline or self.worker.poll() is not None:
                raise RuntimeError("the worker did not join")
            time.sleep(0.05)

    def commit(self, n: int, tier: str = "device") -> list[int]:
        out: list[int] = []
        while len(out) < n:
            k = min(4096, n - len(out))
            ans = self.proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="bench", tier=tier,
                                                   num_blocks=k)).result(600)
            if ans.error:
                raise RuntimeError(f"commit failed: {ans.error}: {ans.detail}")
            out += ans.events[0].blocks
        return out

    def close(self) -> None:
        self.proc.stop("bench done")
        self.worker.terminate()
        try:
            self.worker.wait(20)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


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


# Where a move's time goes, in order: (name, from mark, to mark). Marks are wall-clock ns: the
# bench's own (submit, returned), the control's (control.proc.MoveTraces), the worker's (MoveTimed,
# w_*) and the ack's started_ns/finished_ns. The worker's measured time is w_started..w_finished.
PHASES = [
    ("ask reaches the loop", "submit", "asked"),
    ("control: resolve, fund, fold MoveRequested", "asked", "requested"),
    ("control: commit MoveRequested", "requested", "committed"),
    ("ExecuteMove to the worker's socket", "committed", "w_received"),
    ("worker: decode, hand to engine thread", "w_received", "w_queued"),
    ("worker: engine thread wakes", "w_queued", "w_engine_start"),
    ("engine: before its clock starts", "w_engine_start", "w_started"),
    ("engine: measured (started..finished)", "w_started", "w_finished"),
    ("engine: after its clock stops", "w_finished", "w_engine_end"),
    ("worker: outcome encoded and sent", "w_engine_end", "w_sent"),
    ("outcome to the control's socket", "w_sent", "received"),
    ("control: decode outcome", "received", "decoded"),
    ("control: classify, record MoveAcked (folded after the answer when it commits at once)", "decoded", "recorded"),
    ("control: commit MoveAcked, answer", "recorded", "answered"),
    ("answer reaches the asker", "answered", "returned"),
]


def traced_move(c: Cluster, ask: AskMove) -> tuple[object, dict[str, int], float]:
    """One move through the control process: its ack, the phase marks of its trace, and its wall
    time in seconds from submit to the answer in hand.

    NOTE: the wall time is submit -> answer only. Collecting the trace afterwards (a ``call`` on
    the loop, and waiting for the worker's MoveTimed) is the bench's own work, never the move's."""
    t0 = time.time_ns()
    ans = c.proc.submit(ask).result(600)
    t1 = time.time_ns()
    if ans.error or type(ans.events[0]).__name__ != "MoveAcked":
        raise RuntimeError(f"{ask.kind} through control: {ans}")
    e = ans.events[0]
    mid = ans.move_ids[0]
    marks: dict[str, int] = {}
    for _ in range(100):      # the worker's MoveTimed follows its outcome
        marks = c.proc.call(lambda p: dict(p.traces.by_move.get(mid, {}))).result(10)
        if "w_sent" in marks:
            break
        time.sleep(0.002)
    marks.update(submit=t0, returned=t1, w_started=e.started_ns, w_finished=e.finished_ns)
    return e, marks, (t1 - t0) / 1e9


def breakdown(marks: dict[str, int]) -> dict[str, float] | None:
    """Phase durations in ms (None when a mark is missing); they add up to the whole round trip."""
    if any(a not in marks or b not in marks for _, a, b in PHASES):
        return None
    return {name: (marks[b] - marks[a]) / 1e6 for name, a, b in PHASES}


def phase_medians(breakdowns: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each phase's median over several traced moves (one move's breakdown on a shared 2-core VM
    is one sample of scheduler noise; the medians show where the time goes)."""
    bs = [b for b in breakdowns if b]
    if not bs:
        return None
    return {name: sorted(b[name] for b in bs)[len(bs) // 2] for name in bs[0]}


def overheads(wall_s: float, marks: dict[str, int]) -> dict[str, float]:
    """What the control plane added to one move, three ways (seconds)."""
    out = {"through_control_s": wall_s, "worker_measured_s": (marks["w_finished"] - marks["w_started"]) / 1e9,
           "control_overhead_vs_worker_s": wall_s - (marks["w_finished"] - marks["w_started"]) / 1e9}
    if "w_engine_end" in marks:
        engine_s = (marks["w_engine_end"] - marks["w_engine_start"]) / 1e9
        out.update(engine_call_s=engine_s, control_overhead_vs_engine_call_s=wall_s - engine_s)
    return out


def spill_control_only(url: str, num_blocks: int, reps: int = 60) -> dict:
    """The same number of 2 MiB blocks through the control process to a no-copy worker: the control
    plane's cost of a big move without the copy (precise: each move takes ms, not seconds)."""
    bb = layout_bytes(BIG_LAYOUT)
    c = Cluster(url, "nocopy", "cpu", BIG_LAYOUT, num_blocks + 8, (num_blocks + 8) * bb, traced=True)
    try:
        blocks = c.commit(num_blocks)
        runs = []
        for rep in range(reps + 4):
            kind = "evict" if rep % 2 == 0 else "restore"
            _, marks, wall = traced_move(c, AskMove(ask_id="big", kind=kind, worker=0, blocks=blocks))
            if rep >= 4:
                runs.append((kind, overheads(wall, marks), breakdown(marks)))
    finally:
        c.close()
    out: dict = {"engine": "nocopy", "blocks": num_blocks, "block_bytes": bb, "moves_per_kind": reps // 2}
    for kind in ("evict", "restore"):
        rs = [r for r in runs if r[0] == kind]
        vs = sorted(r[1]["control_overhead_vs_engine_call_s"] for r in rs)
        best = min(rs, key=lambda r: r[1]["control_overhead_vs_engine_call_s"])
        med = sorted(rs, key=lambda r: r[1]["control_overhead_vs_engine_call_s"])[len(rs) // 2]
        out[kind] = {"overhead_vs_engine_call_ms": {"min": vs[0] * 1e3, "p50": pct(vs, 0.5) * 1e3,
                                                    "p90": pct(vs, 0.9) * 1e3, "max": vs[-1] * 1e3},
                     "breakdown_ms_best": best[2], "breakdown_ms_median": med[2],
                     "breakdown_ms_phase_medians": phase_medians([r[2] for r in rs])}
    return out


def dma_hog(seconds: float) -> None:
    """(--dma-hog, run as its own process) Copy 2 GiB device -> pinned host and back, over and
    over, for ``seconds``: the host-memory traffic of a spill and a restore, without the control."""
    import torch  # noqa: PLC0415
    dev = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 31, dtype=torch.uint8, pin_memory=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()


def cpu_spinner() -> subprocess.Popen:
    """(--cpu-spinner) Another process that keeps one CPU busy doing nothing: no vCPU of this
    machine ever has all of them halted."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def under_dma_load(fn, seconds: float = 120.0):
    """``fn()`` while another process streams 2 GiB copies between the GPU and pinned host memory."""
    hog = subprocess.Popen([sys.executable, __file__, "--dma-hog", str(seconds)], cwd=ROOT)
    try:
        time.sleep(5.0)           # its CUDA context and first copies under way
        if hog.poll() is not None:
            raise RuntimeError(f"the DMA load ended early (rc {hog.returncode})")
        return fn()
    finally:
        hog.kill()
        hog.wait(10)


def layout_bytes(spec: str) -> int:
    from dataplane.proc import layout_block_bytes, parse_layout  # noqa: PLC0415
    return layout_block_bytes(parse_layout(spec))


# Ways through the control process the spill is measured (each its own worker and ledger):
#   lane      the worker's engine lane (dataplane/lane.py); no-lane: without it
#   nearly    the worker's MoveNearlyDone before the last chunk; the control polls awake for the ack
#   ahead     the control's CommandAhead before the MoveRequested commits; the lane polls awake
#   pin-worker / pin-control / pinned   the worker's engine thread / the control's loop thread /
#             both, each with its ZMQ I/O thread, on a CPU of its own (events/affinity.py)
# name -> {lane, nearly, ahead, pin_control, pin_worker}
def _variant(name: str) -> dict:
    parts = set(name.split("+"))
    return {"lane": "no-lane" not in parts, "nearly": "nearly" in parts, "ahead": "ahead" in parts,
            "pin_control": bool(parts & {"pinned", "pin-control"}), "pin_worker": bool(parts & {"pinned", "pin-worker"})}


VARIANTS = {n: _variant(n) for n in ("lane", "no-lane", "lane+nearly", "lane+nearly+ahead",
                                     "lane+nearly+ahead+pin-worker", "lane+nearly+ahead+pinned")}


def default_variant() -> str:
    """What ``residency serve`` runs on a GPU host."""
    return "lane+nearly+ahead"


def spill(url: str, device: str, spill_bytes: int, reps: int = 3, variants: list[str] | None = None) -> dict:
    """A large spill device->host: in this process (the engine alone) vs through the control process,
    once per variant (the headline figures are the default variant's; all are under "variants")."""
    import torch  # noqa: PLC0415

    from dataplane.engine import Engine  # noqa: PLC0415
    from dataplane.pools import KVLayout  # noqa: PLC0415
    from dataplane.proc import layout_block_bytes, parse_layout  # noqa: PLC0415
    from events.commands import CommitBlocks, ExecuteMove  # noqa: PLC0415

    if device == "cpu":
        torch.set_num_threads(1)          # like the worker (--torch-threads 1): the same copy engine on both sides
    layout = parse_layout(BIG_LAYOUT)
    bb = layout_block_bytes(layout)
    n = max(1, spill_bytes // bb)
    host_bytes = (n + 8) * bb
    kv = KVLayout(*layout[:4], dtype=layout[4])
    d = tempfile.mkdtemp(prefix="rcb-", dir="/tmp")
    out: dict = {"bytes": n * bb, "blocks": n, "block_bytes": bb}
    try:
        eng = Engine(kv, n + 8, host_bytes, d, Engine.pinned_bytes_needed(kv, n + 8, host_bytes), device,
                     disk_bytes=0, fsync=False)
        eng.commit_blocks(CommitBlocks(request_id="c", session=None, tier="device", blocks=list(range(n)), seed=1))
        times = []
        for rep in range(7):      # evict, restore, ...: the first evict compiles; 3 more evicts are timed
            kind, src, dst = ("evict", "device", "host") if rep % 2 == 0 else ("restore", "host", "device")
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = eng.execute(ExecuteMove(move_id=f"in-{rep}", kind=kind, src=src, dst=dst, blocks=list(range(n)),
                                        keep_source=False, deadline_ns=time.time_ns() + 600 * 10**9))
            times.append((kind, time.perf_counter() - t0, type(o).__name__))
        eng.close()
        spills = [t for k, t, _ in times[2:] if k == "evict"]
        out["in_process_s"] = min(spills)
        out["in_process_gb_s"] = n * bb / min(spills) / 1e9
        out["in_process_runs"] = times
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    variants = variants or [default_variant()]
    headline = default_variant() if default_variant() in variants else variants[0]
    out["headline_variant"] = headline
    out["variants"] = {}
    for name in variants:
        var = VARIANTS[name]
        # a ledger of its own per variant (a second control on one ledger would write the first's worker off)
        vurl = url[:-3] + f"-{name}.db" if url.startswith("sqlite") and url.endswith(".db") else url
        v = through_control(vurl, device, n, host_bytes, reps, out["in_process_s"], var)
        out["variants"][name] = v
        if name == headline:
            out.update(v)
    return out


def through_control(url: str, device: str, n: int, host_bytes: int, reps: int, in_process_s: float,
                    var: dict) -> dict:
    bb = layout_bytes(BIG_LAYOUT)
    control_cpu, (worker_cpu,) = affinity.plan(1)
    cpus = (control_cpu if var["pin_control"] else None, worker_cpu if var["pin_worker"] else None)
    out: dict = {**var, "cpus": list(cpus)}
    c = Cluster(url, "real", device, BIG_LAYOUT, n + 8, host_bytes, traced=True, lane=var["lane"], cpus=cpus,
                nearly_done=var["nearly"], ahead=var["ahead"])
    try:
        blocks = c.commit(n)
        runs = []
        for rep in range(reps):
            kind = "evict" if rep % 2 == 0 else "restore"
            e, marks, wall = traced_move(c, AskMove(ask_id="big", kind=kind, worker=0, blocks=blocks))
            runs.append((kind, wall, (e.finished_ns - e.started_ns) / 1e9, overheads(wall, marks), breakdown(marks)))
        spills = [r for r in runs if r[0] == "evict"]
        best = min(spills, key=lambda r: r[1])
        vs_engine = sorted(r[3]["control_overhead_vs_engine_call_s"] for r in spills
                           if "control_overhead_vs_engine_call_s" in r[3])
        out.update(through_control_s=best[1], worker_measured_s=best[2], through_control_gb_s=n * bb / best[1] / 1e9,
                   control_overhead_s=best[1] - in_process_s,
                   control_overhead_vs_worker_s=best[1] - best[2],
                   control_overhead_vs_engine_call_s=best[3].get("control_overhead_vs_engine_call_s"),
                   control_overhead_vs_engine_call_p50_s=vs_engine[len(vs_engine) // 2] if vs_engine else None,
                   control_overhead_vs_engine_call_all_s=vs_engine,
                   breakdown_ms=best[4], breakdown_ms_phase_medians=phase_medians([r[4] for r in spills]),
                   through_control_runs=[r[:3] for r in runs])
    finally:
        c.close()
        if device.startswith("cuda"):
            import torch  # noqa: PLC0415
            torch.cuda.empty_cache()
    return out


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
                    f"p50 {v['control_overhead_vs_engine_call_p50_s'] * 1e3:.3f}  ({len(vs)} spills)"
                    + ("  <- headline" if name == s["headline_variant"] else "")
                    + ("  (this host's default)" if name == default_variant() else ""))
            rows.append(line)
            print(line)
    shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "bench": "control", "date": dt.date.today().isoformat(), "git_commit": git_commit(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "device": args.device},
        "targets": {"round_trip_p50_ms_sqlite": 1.0, "sustained_moves_per_s": 5000},
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
