"""What a worker's warm-up of its mover buys: the first moves of a fresh process, with and without it.

Each round starts a fresh Python process (kernels compile, or load from Triton's disk cache, once
per process), builds a mover of 2 MiB blocks (the moves bench's layout), optionally runs
``Mover.warm_up()`` (what ``python -m residency.dataplane.proc`` does on a GPU before its Hello), then
times its first 1-block spill and restore and its first 128-block spill. Rounds alternate
cold / warmed, --rounds of each. Prints a table; writes bench/results/warm-up-<date>-<device>.json.

    python3 bench/warm_up.py [--device cuda] [--rounds 3]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from commit import git_commit  # noqa: E402  (bench/commit.py)

CHILD = r"""
import json, sys, tempfile, time
import torch
from residency.dataplane.mover import Mover
from residency.dataplane.pools import KVLayout
from residency.events.commands import CommitBlocks, ExecuteMove

device, warm = sys.argv[1], sys.argv[2] == "1"
kv = KVLayout(32, 16, 8, 128, dtype="bfloat16")
n = 512
d = tempfile.mkdtemp()
e = Mover(kv, n, n * kv.block_bytes, d, Mover.pinned_bytes_needed(kv, n, n * kv.block_bytes), device,
          disk_bytes=0, fsync=False)
e.commit_blocks(CommitBlocks(request_id="c", session=None, tier="device", blocks=list(range(200)), seed=1))
out = {"warm_up_s": None}
if warm:
    out["warm_up_s"] = e.warm_up()["seconds"]

def timed(mid, kind, src, dst, blocks):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = e.execute(ExecuteMove(move_id=mid, kind=kind, src=src, dst=dst, blocks=blocks, keep_source=False,
                              deadline_ns=time.time_ns() + 60 * 10**9))
    assert type(o).__name__ == "MoveAcked", o
    return time.perf_counter() - t0

out["first_1_block_spill_s"] = timed("a", "evict", "device", "host", [0])
out["first_1_block_restore_s"] = timed("b", "restore", "host", "device", [0])
out["first_128_block_spill_s"] = timed("c", "evict", "device", "host", list(range(1, 129)))
out["second_1_block_spill_s"] = timed("d", "evict", "device", "host", [0])
e.close()
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"cold": [], "warmed": []}
    for _ in range(args.rounds):
        for label, flag in (("cold", "0"), ("warmed", "1")):
            p = subprocess.run([sys.executable, "-c", CHILD, args.device, flag], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(p.stdout[-2000:], p.stderr[-2000:], file=sys.stderr)
                return 1
            runs[label].append(json.loads(line[len("RESULT "):]))
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
           for label, rs in runs.items()}
    rows = ["| first moves of a fresh process (median of rounds) | cold | warmed |", "|---|---|---|"]
    for k in ("first_1_block_spill_s", "first_1_block_restore_s", "first_128_block_spill_s", "second_1_block_spill_s"):
        rows.append(f"| {k.removesuffix('_s').replace('_', ' ')} | {1e3 * med['cold'][k]:.2f} ms | "
                    f"{1e3 * med['warmed'][k]:.2f} ms |")
    rows.append(f"| warm-up itself (before Hello) | | {1e3 * med['warmed']['warm_up_s']:.1f} ms |")
    print("\n".join(rows))
    doc = {"bench": "warm_up", "date": dt.date.today().isoformat(), "git_commit": git_commit(),
           "device": args.device, "rounds": args.rounds, "median": med, "runs": runs, "table": rows}
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / (
        f"warm-up-{doc['date']}-{'cpu' if args.device == 'cpu' else 'h200'}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
