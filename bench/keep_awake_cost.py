"""What keep_awake's spinners cost other work: the same steps timed with the spinners asleep and
spinning (control/keep_awake.py: one SCHED_IDLE spinner per CPU), alternated.

Steps: ``cpu`` (one thread: 512x512 matmuls and a pure-Python loop, what a CPU worker's model and
the control's loop do), and on a GPU ``launch`` (200 small kernels launched back to back and
synchronized: a decode step's launch-bound host side). A spinner on the CPU a step runs on is
preempted at once (SCHED_IDLE); what this measures is what is left: a spinner on a sibling
hyperthread of the host, or the host's own scheduling of the guest's vCPUs.

    python bench/keep_awake_cost.py [--rounds 10] [--out PATH]

Prints a table; writes bench/results/keep-awake-cost-<date>-<machine>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from residency.control.keep_awake import KeepAwake  # noqa: E402  (before bench/ joins the path: bench/control.py)

sys.path.insert(0, str(ROOT / "bench"))
from control_cluster import git_commit, write_result  # noqa: E402


def cpu_step() -> None:
    a, b = cpu_step.a, cpu_step.b
    for _ in range(20):
        a @ b
    x = 0
    for i in range(200_000):
        x += i


def launch_step() -> None:
    t = launch_step.t
    for _ in range(200):
        t.add_(1.0)
    torch.cuda.synchronize()


def timed_ms(step, reps: int) -> float:
    """The best of ``reps`` runs of ``step``, in ms (the steady cost, not the noise)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="alternations of asleep / spinning")
    ap.add_argument("--reps", type=int, default=5, help="runs of a step per round (its best is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_step.a, cpu_step.b = torch.randn(512, 512), torch.randn(512, 512)
    steps = {"cpu": cpu_step}
    if torch.cuda.is_available():
        launch_step.t = torch.randn(1024, device="cuda")
        steps["launch"] = launch_step
    for step in steps.values():
        step()
    ka = KeepAwake()
    times: dict[str, dict[str, list[float]]] = {s: {"asleep": [], "spinning": []} for s in steps}
    try:
        for _ in range(args.rounds):
            for mode in ("asleep", "spinning"):
                if mode == "spinning":
                    ka.until(time.monotonic_ns() + 3600 * 10**9)
                else:
                    ka.end_at(0)
                time.sleep(0.2)           # the spinners asleep or spinning by now
                for name, step in steps.items():
                    times[name][mode].append(timed_ms(step, args.reps))
    finally:
        ka.stop()
    summary = {name: {mode: round(statistics.median(v), 3) for mode, v in by.items()} for name, by in times.items()}
    print(f"{'step':8s} {'asleep ms':>10s} {'spinning ms':>12s} {'change':>8s}   (medians of {args.rounds} rounds, "
          f"spinners on {len(ka.cpus)} CPUs)")
    for name, m in summary.items():
        m["change_fraction"] = round(m["spinning"] / m["asleep"] - 1, 4)
        print(f"{name:8s} {m['asleep']:10.3f} {m['spinning']:12.3f} {100 * m['change_fraction']:+7.1f}%")
    machine = "h200" if torch.cuda.is_available() else "cpu"
    out = {"bench": "keep_awake_cost", "date": dt.date.today().isoformat(), "machine": machine,
           "git_commit": git_commit(), "cpus": len(ka.cpus), "rounds": args.rounds, "reps": args.reps,
           "median_ms": summary, "all_ms": times}
    write_result(out, "keep-awake-cost", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
