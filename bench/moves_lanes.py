"""Does spreading a move's 2 MiB DMAs over several copy streams ("lanes") close the gap between
"both at once" and the bare bidirectional copy?

The mover's both-at-once stays a little short of a bare 2 GiB copy each way, and one-way
restores lose more than spills (scattered device rows on one side, 2 MiB DMAs). A copy engine that ends one DMA before it starts the next leaves
the link idle for the read latency at every boundary; two streams per direction let two copy
engines overlap those boundaries. No mover, no bookkeeping: pinned host rows (from the mover's
budget authority) and device rows, the mover's DMA issuer (cudaMemcpyBatchAsync where there is
one), a batch per 64 blocks as the mover issues them. Rounds interleave every variant:

    whole        one 2 GiB copy per direction (the ceiling)
    runs_L       1024 contiguous 2 MiB DMAs per direction, batches alternating over L streams
    scattered_L  the same with the device rows at random over a 3x larger pool (the mover's case)

Each: d2h alone, h2d alone, both at once; GB/s medians and both over the mean one-way rate.

Then the mover itself (bench/moves.py's blocks and mover, made with the most lanes asked for),
per round, per copy modes (--engine-modes) and lane count: a spill of A, a spill of B with a restore of A by submit_many, a
restore of B, and the bare copy both ways; "both over one" per round as bench/moves.py's
``_paired`` figure, and both at once over the bare copy both ways of the same round.
The mover itself has one stream per direction; the lanes here are the bench's own
(moves_variants.py: ``Lanes``, ``BenchCopier``).

    python3 bench/moves_lanes.py [--out lanes.json] [--reps 7] [--lanes 1,2,4] [--engine-reps 9]
                                 [--engine-modes dma/dma,dma/staged,staged/staged]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from residency.dataplane.moves.dma import dma_issuer  # noqa: E402
from residency.dataplane.pools.budget import PinnedBudget  # noqa: E402
from moves_report import device_name, git_commit  # noqa: E402

GB = 1e9
ROW_WORDS = (2 << 20) // 4          # one 2 MiB block as int32 words
BATCH = 64                          # blocks per batch, as the mover's pipeline_blocks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--lanes", default="1,2,4")
    p.add_argument("--engine-reps", type=int, default=9, help="mover rounds per lane count (0: none)")
    p.add_argument("--engine-modes", default="dma/dma,dma/staged,staged/staged",
                   help="copy modes d2h/h2d the mover part compares")
    p.add_argument("--quick", action="store_true", help="the mover part only, tiny, on the CPU: checks the script")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lanes = [int(x) for x in a.lanes.split(",")]
    if a.quick:
        print(json.dumps(mover_lanes(lanes, 2, a.engine_modes.split(","), quick=True)["variants"].keys().__repr__()))
        return 0
    if not torch.cuda.is_available():
        print("moves_lanes: needs a GPU (--quick checks the script on the CPU)")
        return 0
    res = copies(a, lanes)               # its buffers are gone when it returns
    torch.cuda.empty_cache()
    if a.engine_reps:
        res["mover"] = mover_lanes(lanes, a.engine_reps, a.engine_modes.split(","))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def copies(a, lanes: list[int]) -> dict:
    """Bare DMAs: the whole copy, contiguous 2 MiB runs and scattered ones, over 1..max lanes."""
    dev, n = torch.device("cuda:0"), a.blocks
    budget = PinnedBudget(2 * n * ROW_WORDS * 4 + 4096, pin=True)
    bufs = [budget.alloc("lanes-h2d-source", (n, ROW_WORDS), torch.int32),
            budget.alloc("lanes-d2h-destination", (n, ROW_WORDS), torch.int32)]
    h_src, h_dst = bufs[0].tensor, bufs[1].tensor
    pool = torch.randint(-(2**31), 2**31, (3 * n, ROW_WORDS), dtype=torch.int32, device=dev)
    h_src.copy_(pool[:n])
    rng = random.Random(1)
    rows = list(range(3 * n))
    rng.shuffle(rows)
    out_rows, in_rows = rows[:n], rows[n:2 * n]      # d2h reads these, h2d writes those
    dma = dma_issuer(dev)
    streams = {d: [torch.cuda.Stream(dev, priority=-8) for _ in range(max(lanes))] for d in ("d2h", "h2d")}

    def issue(direction: str, k: int, scattered: bool) -> None:
        dev_rows = (out_rows if direction == "d2h" else in_rows) if scattered else list(range(n))
        for i, lo in enumerate(range(0, n, BATCH)):
            s = streams[direction][i % k]
            with torch.cuda.stream(s):
                if direction == "d2h":
                    dma.copy_runs(s, h_dst, pool, [(dev_rows[j], j, 1) for j in range(lo, min(n, lo + BATCH))])
                else:
                    dma.copy_runs(s, pool, h_src, [(j, dev_rows[j], 1) for j in range(lo, min(n, lo + BATCH))])

    def whole(direction: str) -> None:
        s = streams[direction][0]
        with torch.cuda.stream(s):
            if direction == "d2h":
                h_dst.copy_(pool[:n], non_blocking=True)
            else:
                pool[n:2 * n].copy_(h_src, non_blocking=True)

    variants = {"whole": lambda d: whole(d)}
    for k in lanes:
        variants[f"runs_{k}"] = lambda d, k=k: issue(d, k, False)
        variants[f"scattered_{k}"] = lambda d, k=k: issue(d, k, True)

    def timed(fn) -> float:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    walls = {v: {"d2h": [], "h2d": [], "both": []} for v in variants}
    for v, fn in variants.items():          # warm-up
        timed(lambda: (fn("d2h"), fn("h2d")))
    for _ in range(a.reps):
        for v, fn in variants.items():
            walls[v]["d2h"].append(timed(lambda: fn("d2h")))
            walls[v]["h2d"].append(timed(lambda: fn("h2d")))
            walls[v]["both"].append(timed(lambda: (fn("d2h"), fn("h2d"))))
    nbytes = n * ROW_WORDS * 4
    res = {"bench": "moves_lanes", "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
           "device": device_name(dev), "dma_issuer": dma.name, "blocks": n, "reps": a.reps, "variants": {}}
    bare_both = 2 * nbytes / statistics.median(walls["whole"]["both"]) / GB
    print(f"{'variant':<14}{'d2h GB/s':>10}{'h2d GB/s':>10}{'both GB/s':>11}{'both/one':>10}{'of bare both':>14}")
    for v, w in walls.items():
        d2h, h2d = (nbytes / statistics.median(w[k]) / GB for k in ("d2h", "h2d"))
        both = 2 * nbytes / statistics.median(w["both"]) / GB
        row = {"d2h_GBps": round(d2h, 2), "h2d_GBps": round(h2d, 2), "both_GBps": round(both, 2),
               "both_vs_one_direction": round(both / ((d2h + h2d) / 2), 4),
               "both_fraction_of_bare_both": round(both / bare_both, 4),
               "walls_ms": {k: [round(1e3 * x, 2) for x in xs] for k, xs in w.items()}}
        res["variants"][v] = row
        print(f"{v:<14}{d2h:>10.1f}{h2d:>10.1f}{both:>11.1f}{row['both_vs_one_direction']:>10.3f}"
              f"{row['both_fraction_of_bare_both']:>14.3f}")
    for buf in bufs:
        buf.close()
    return res


def mover_variants(lanes: list[int], modes: list[str]) -> list[tuple[str, str, int]]:
    """(d2h mode, h2d mode, lanes) to run: lanes only matter where a direction is "dma"."""
    out = []
    for m in modes:
        d2h, h2d = m.split("/")
        for k in (lanes if "dma" in (d2h, h2d) else lanes[:1]):
            out.append((d2h, h2d, k))
    return out


def mover_lanes(lanes: list[int], reps: int, modes: list[str], quick: bool = False) -> dict:
    """The mover per (copy modes, lanes), rounds interleaved (see the module's docstring)."""
    import logging

    import structlog

    import moves as mb
    from moves_parts import both_over_one, sync

    args = argparse.Namespace(blocks=1024, pipeline_blocks=64, reps=reps, layers=32, page_tokens=16, kv_heads=8,
                              head_dim=128, latency_iters=1, chunk_blocks=128, matmuls=1, seed=1, cpu=False,
                              quick=quick, dma_lanes=max(lanes))
    if quick:                                # tiny sizes, on the CPU: checks the script, measures nothing
        args.blocks, args.layers, args.page_tokens, args.kv_heads, args.head_dim, args.cpu = 16, 2, 4, 2, 16, True
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    b = mb.Bench(args)
    e = b.e
    variants = mover_variants(lanes, modes)
    name = {v: f"{v[0]}/{v[1]} x{v[2]}" for v in variants}
    out: dict = {"engine_default_copy_modes": dict(e.ctx.copy_modes), "variants": {}}
    rounds = {v: {"spill": [], "restore": [], "both": [], "bare_both": []} for v in variants}

    def use(v):
        e.ctx.copy_modes.update(d2h=v[0], h2d=v[1])
        b.lanes.count = v[2]

    try:
        for v in variants:                   # warm-up: every variant once
            use(v)
            b.run(b.mv("evict", "device", "host", b.A))
            b.run(b.mv("restore", "host", "device", b.A))
        for _ in range(reps):
            for v in variants:
                use(v)
                r = rounds[v]
                r["spill"].append(b.run(b.mv("evict", "device", "host", b.A))[1])
                out_cmd, in_cmd = b.mv("evict", "device", "host", b.B), b.mv("restore", "host", "device", b.A)
                sync(b.dev)
                t0 = time.perf_counter()
                t_out, t_in = e.submit_many([out_cmd, in_cmd])
                acks = e.wait(t_in), e.wait(t_out)
                r["both"].append(time.perf_counter() - t0)
                assert all(type(x).__name__ == "MoveAcked" for x in acks), acks
                r["restore"].append(b.run(b.mv("restore", "host", "device", b.B))[1])
                r["bare_both"].append(b.bare_both())
        e.check_integrity()
        print(f"\n{'mover':<18}{'spill GB/s':>11}{'restore GB/s':>13}{'both GB/s':>11}{'both/one':>10}"
              f"{'of bare both':>14}")
        for v, r in rounds.items():
            paired = [both_over_one(w, s, i) for w, s, i in zip(r["both"], r["spill"], r["restore"])]
            of_bare = [bb / w for w, bb in zip(r["both"], r["bare_both"])]
            row = {f"{x}_GBps": round((2 if x == "both" else 1) * b.bytes / statistics.median(r[x]) / GB, 2)
                   for x in ("spill", "restore", "both")}
            row.update(both_vs_one_direction_paired=round(statistics.median(paired), 4),
                       both_fraction_of_bare_both_paired=round(statistics.median(of_bare), 4),
                       paired_rounds=[round(x, 4) for x in paired], of_bare_rounds=[round(x, 4) for x in of_bare],
                       walls_ms={x: [round(1e3 * w, 2) for w in ws] for x, ws in r.items()})
            out["variants"][name[v]] = row
            print(f"{name[v]:<18}{row['spill_GBps']:>11.1f}{row['restore_GBps']:>13.1f}{row['both_GBps']:>11.1f}"
                  f"{row['both_vs_one_direction_paired']:>10.3f}{row['both_fraction_of_bare_both_paired']:>14.3f}")
    finally:
        b.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
