"""What one ZMQ hop between two processes costs after an idle gap, by where the threads sit.

The control overhead of a big move (bench/control.py, spill) is mostly two ZMQ hops that follow an
idle gap: the command after the control's commit, the ack after ~40 ms of copying. Each hop wakes
up to three threads (the sender's ZMQ I/O thread, the receiver's I/O thread, the receiving
thread), and in a VM a thread on an idle (halted) vCPU wakes slowly. This bench measures one hop
each way, control-like parent (ROUTER) <-> worker-like child (DEALER) over ipc://, the child
"working" for --work-ms between them (sleeping, then spinning through the last --tail-ms as the
engine does through a move's last chunk), under these placements:

    default       threads where the kernel puts them
    pinned        each process's app thread and its ZMQ I/O thread share one CPU (a different
                  CPU per process): a wake from a sibling on a running CPU, not from a halted one
    headsup       the child sends a small message --tail-ms before its ack; the parent, on it,
                  polls without sleeping (sched_yield between polls) until the ack
    pinned+headsup  both

Clock: CLOCK_MONOTONIC (perf_counter_ns) is one clock for both processes. Prints a table; writes
bench/results/zmq-wake-<date>-<machine>.json.

    python bench/zmq_wake.py [--reps 40] [--work-ms 40] [--tail-ms 1]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commit import git_commit  # noqa: E402  (bench/commit.py)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"default": (False, False), "pinned": (True, False), "headsup": (False, True),
            "pinned+headsup": (True, True)}


def pin_here(ctx: zmq.Context, cpu: int) -> None:
    """This thread and the context's I/O thread (started by the first socket) on ``cpu``."""
    ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    os.sched_setaffinity(0, {cpu})      # pid 0: the calling thread (Linux)


def child(endpoint: str, cpu: int, pinned: bool, headsup: bool, work_ms: float, tail_ms: float) -> None:
    ctx = zmq.Context()
    if pinned:
        pin_here(ctx, cpu)
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send(b"hello")
    while True:
        msg = s.recv()
        t = time.perf_counter_ns()
        if msg == b"stop":
            break
        hop1 = t - int(msg)
        time.sleep(max(0.0, (work_ms - tail_ms) / 1e3))
        if headsup:
            s.send(b"nearly")
        end = time.perf_counter_ns() + int(tail_ms * 1e6)
        while time.perf_counter_ns() < end:
            pass
        s.send_multipart([str(hop1).encode(), str(time.perf_counter_ns()).encode()])
    s.close(0)
    ctx.term()


def parent(variant: str, reps: int, work_ms: float, tail_ms: float, gap_ms: float, cpus: tuple[int, int]) -> dict:
    pinned, headsup = VARIANTS[variant]
    d = tempfile.mkdtemp(prefix="zw-")
    endpoint = f"ipc://{d}/s"
    ctx = zmq.Context()
    if pinned:
        pin_here(ctx, cpus[0])
    r = ctx.socket(zmq.ROUTER)
    r.bind(endpoint)
    p = subprocess.Popen([sys.executable, __file__, "--child", endpoint, "--cpu", str(cpus[1]),
                          "--variant", variant, "--work-ms", str(work_ms), "--tail-ms", str(tail_ms)])
    ident, _ = r.recv_multipart()
    hop1, hop2 = [], []
    try:
        for i in range(reps + 3):
            time.sleep(gap_ms / 1e3)
            r.send_multipart([ident, str(time.perf_counter_ns()).encode()])
            while True:
                if headsup:
                    frames = r.recv_multipart()
                    if frames[1] == b"nearly":      # poll awake until the ack
                        while not r.poll(0):
                            os.sched_yield()
                        frames = r.recv_multipart()
                else:
                    frames = r.recv_multipart()
                t = time.perf_counter_ns()
                if len(frames) == 3:
                    break
            if i >= 3:
                hop1.append((int(frames[1])) / 1e6)
                hop2.append((t - int(frames[2])) / 1e6)
    finally:
        r.send_multipart([ident, b"stop"])
        p.wait(10)
        r.close(0)
        ctx.term()
        if pinned:
            os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()) | set(range(os.cpu_count() or 1)))

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"min_ms": xs[0], "p50_ms": xs[len(xs) // 2], "p90_ms": xs[int(0.9 * len(xs))], "max_ms": xs[-1]}

    return {"variant": variant, "command_hop": stats(hop1), "ack_hop": stats(hop2), "reps": reps,
            "command_hop_all_ms": hop1, "ack_hop_all_ms": hop2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--work-ms", type=float, default=40.0, help="the child's work between command and ack")
    ap.add_argument("--tail-ms", type=float, default=1.0, help="of which spun through at the end")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="the parent's pause before each command")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--machine", default=None, help="name in the result file (default: cpu, or h200 with a GPU)")
    ap.add_argument("--out", default=None, help="where the JSON goes (default: bench/results/zmq-wake-<date>-<machine>.json)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--variant", default="default")
    args = ap.parse_args()
    if args.child:
        pinned, headsup = VARIANTS[args.variant]
        child(args.child, args.cpu, pinned, headsup, args.work_ms, args.tail_ms)
        return 0
    allowed = sorted(os.sched_getaffinity(0))
    cpus = (allowed[min(2, len(allowed) - 1)], allowed[min(4, len(allowed) - 1)])
    rows = []
    for v in args.variants.split(","):
        res = parent(v, args.reps, args.work_ms, args.tail_ms, args.gap_ms, cpus)
        rows.append(res)
        c, a = res["command_hop"], res["ack_hop"]
        print(f"{v:16s} command hop p50 {c['p50_ms']:.3f} ms (min {c['min_ms']:.3f}, p90 {c['p90_ms']:.3f})   "
              f"ack hop p50 {a['p50_ms']:.3f} ms (min {a['min_ms']:.3f}, p90 {a['p90_ms']:.3f})", flush=True)
    machine = args.machine or ("h200" if Path("/dev/nvidia0").exists() else "cpu")
    out = {"bench": "zmq_wake", "date": dt.date.today().isoformat(), "machine": machine, "git_commit": git_commit(),
           "host": platform.node(), "cpu_count": os.cpu_count(), "cpus_used": cpus, "work_ms": args.work_ms,
           "tail_ms": args.tail_ms, "gap_ms": args.gap_ms, "zmq": zmq.zmq_version(), "results": rows}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"zmq-wake-{out['date']}-{machine}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
