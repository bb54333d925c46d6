"""Why "both at once" (a spill and a restore together) stays below the bidirectional ceiling.

bench/moves.py measures it, and its bidir_probe compares the bare staged copy path, without any
bookkeeping, with plain copies both ways (bench/RESULTS.md has the figures). This probe takes that apart on the same mover and
blocks (1024 scattered 2 MiB blocks each way), aggregate GB/s, median of --reps, rounds interleaved:

    copy paths   plain copies on the mover's / default-priority streams, the host pool as the
                 host side, staged in one direction only, staged both ways with staging buffers of
                 16..128 blocks, staged both ways with chunks interleaved, with default-priority streams
    host         cProfile of Mover.submit for a 2 GiB spill and restore: where begin's host time goes
    one_block    cProfile over 100 one-block spills and restores: where a small move's host time goes
    both         the mover's spill+restore wall, and when each move's first chunk was enqueued:
                 two submits, and submit_many with first chunks of 1, 2, 3 pipeline chunks
    both_dma     the same through submit_many, the mover's DMAs issued through torch vs
                 cudaMemcpyAsync (dataplane/moves/dma.py)
    dma_issue    host µs to enqueue 64 scattered block DMAs, torch vs cudaMemcpyAsync

    python3 bench/moves_probe.py [--out probe.json]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import moves as mb  # noqa: E402  (bench/moves.py: the same mover set-up)
from residency.dataplane.moves import Copier, DeviceStaging  # noqa: E402
from residency.dataplane.moves.copy import coalesce  # noqa: E402

GB = 1e9


def _args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--pipeline-blocks", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--sections", default="both,both_dma,dma_issue,copy_paths,host")
    a = p.parse_args(argv)
    a.layers, a.page_tokens, a.kv_heads, a.head_dim = 32, 16, 8, 128
    a.latency_iters, a.chunk_blocks, a.matmuls, a.seed, a.cpu, a.quick = 1, 128, 1, 1, False, False
    return a


@contextlib.contextmanager
def swapped(obj, **attrs):
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def copy_paths(b: mb.Bench, reps: int) -> dict:
    e, d = b.e, b.dev
    ctx, dp, hp, s = e.ctx, e.device_pool, e.host_pool, e.ctx.streams
    n = b.n
    b.run(b.mv("evict", "device", "host", b.A))             # A on the host, B on the device
    b_dev = dp.slots_of(b.B)
    free_host = sorted(hp.table._free)[:n]
    a_host = sorted(hp.slots_of(b.A))
    free_dev = sorted(dp.table._free)[:n]
    h_a, h_b = b.h_a.tensor, b.h_b.tensor
    runs = {"free_host_runs": len(coalesce(free_host, free_host)), "a_host_runs": len(coalesce(a_host, a_host)),
            "b_dev_runs": len(coalesce(b_dev, b_dev)), "free_dev_runs": len(coalesce(free_dev, free_dev))}

    def plain_out():
        with torch.cuda.stream(s.d2h):
            h_b.copy_(b.d_a, non_blocking=True)

    def plain_in():
        with torch.cuda.stream(s.h2d):
            b.d_b.copy_(h_a, non_blocking=True)

    def pool_out():                      # into the host pool's free slots, in their runs
        with torch.cuda.stream(s.d2h):
            for a, c, k in coalesce(list(range(n)), free_host):
                hp.words[c:c + k].copy_(b.d_a[a:a + k], non_blocking=True)

    def pool_in():                       # out of A's host rows, in their runs
        with torch.cuda.stream(s.h2d):
            for a, c, k in coalesce(a_host, list(range(n))):
                b.d_b[c:c + k].copy_(hp.words[a:a + k], non_blocking=True)

    def staged_out():
        return Copier(ctx, "d2h", dp.words, b_dev, hp.words, free_host, mode="staged")

    def staged_in():
        return Copier(ctx, "h2d", hp.words, a_host, dp.words, free_dev, mode="staged")

    def whole(*parts):
        def go():
            cs = [p() for p in parts]
            for c in cs:
                if c is not None:
                    c.enqueue(0, n)
            for c in cs:
                if c is not None:
                    c.done().synchronize()
        return go

    def interleaved():
        o, i = staged_out(), staged_in()
        step = ctx.staging.rows
        for lo in range(0, n, step):
            o.enqueue(lo, min(n, lo + step))
            i.enqueue(lo, min(n, lo + step))
        o.done().synchronize()
        i.done().synchronize()

    def with_staging(rows, fn):
        def go():
            with swapped(ctx, staging=stagings[rows]):
                fn()
        return go

    def default_prio(fn):
        def go():
            with swapped(s, **plain_streams):
                fn()
        return go

    plain_streams = {k: torch.cuda.Stream(d) for k in ("d2h", "h2d", "stage_d2h", "stage_h2d")}
    stagings = {r: DeviceStaging(b.layout, r, d) for r in (16, 32, 128)}
    variants = {
        "plain_engine_streams": whole(plain_out, plain_in),
        "plain_default_prio": default_prio(whole(plain_out, plain_in)),
        "host_pool_plain": whole(pool_out, pool_in),
        "staged_out_plain_in": whole(staged_out, plain_in),
        "plain_out_staged_in": whole(plain_out, staged_in),
        "staged_both_64": whole(staged_out, staged_in),
        "staged_both_64_interleaved": interleaved,
        "staged_both_64_default_prio": default_prio(whole(staged_out, staged_in)),
        "staged_both_16": with_staging(16, whole(staged_out, staged_in)),
        "staged_both_32": with_staging(32, whole(staged_out, staged_in)),
        "staged_both_128": with_staging(128, whole(staged_out, staged_in)),
        "staged_out_only": whole(staged_out),
        "staged_in_only": whole(staged_in),
    }
    one_way = {"staged_out_only", "staged_in_only"}
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for fn in variants.values():      # warm every path once (allocations, compiles)
            mb.timed(d, fn)
        for _ in range(reps):
            for k, fn in variants.items():
                times[k].append(mb.timed(d, fn))
    finally:
        b.run(b.mv("restore", "host", "device", b.A))
    out = {k: (1 if k in one_way else 2) * b.bytes / statistics.median(v) / GB for k, v in times.items()}
    return {"GBps": out, "runs": runs}


def host_profile(b: mb.Bench) -> dict:
    """cProfile of one submit (begin) of a 2 GiB spill and of a 2 GiB restore."""
    e = b.e
    out = {}
    for label, mk in (("spill", lambda: b.mv("evict", "device", "host", b.A)),
                      ("restore", lambda: b.mv("restore", "host", "device", b.A))):
        cmd = mk()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        t0 = time.perf_counter_ns()
        pr.enable()
        t = e.submit(cmd)
        pr.disable()
        t1 = time.perf_counter_ns()
        ack = e.wait(t)
        assert ack.__class__.__name__ == "MoveAcked", ack
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(22)
        st.sort_stats("cumulative").print_stats(30)
        out[label] = {"submit_us_profiled": (t1 - t0) / 1e3, "phases_us": mb.phases(e.last_phases),
                      "profile": buf.getvalue()}
        print(f"--- submit {label}: {(t1 - t0) / 1e3:.0f} us profiled")
        print(buf.getvalue()[:6000])
    return out


def one_block_profile(b: mb.Bench, iters: int = 100) -> dict:
    """cProfile over ``iters`` one-block spills and restores (submit + wait each): where a small
    move's host time goes (its begin.rest is most of its latency)."""
    e, one = b.e, [b.A[0]]
    for _ in range(5):                                   # compiled, warm
        b.run(b.mv("evict", "device", "host", one))
        b.run(b.mv("restore", "host", "device", one))
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter_ns()
    pr.enable()
    for _ in range(iters):
        b.run(b.mv("evict", "device", "host", one))
        b.run(b.mv("restore", "host", "device", one))
    pr.disable()
    wall_us = (time.perf_counter_ns() - t0) / 1e3 / (2 * iters)
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
    print(f"--- one-block moves: {wall_us:.0f} us each, profiled")
    print(buf.getvalue()[:9000])
    return {"iters": iters, "move_us_profiled": wall_us, "profile": buf.getvalue()}


def both(b: mb.Bench, reps: int) -> dict:
    """The mover's spill+restore, submitted one after the other and through submit_many with
    first chunks 1, 2 and 3 pipeline chunks long (``submit_many_x<k>``; the mover's default is
    ``dataplane.mover.FIRST_CHUNKS_TOGETHER``), and x2 without the first move's longer first step
    (``FIRST_LEAD_BLOCKS``; ``_nolead``), two interleaved rounds."""
    import residency.dataplane.mover as mover_mod

    res = {}
    hows = ("sequential", "submit_many_x1", "submit_many_x2", "submit_many_x3", "submit_many_x2_nolead")
    for how in hows + hows:
        k = mover_mod.FIRST_CHUNKS_TOGETHER if how == "sequential" else int(how.split("_x")[1][0])
        lead = 0 if how.endswith("nolead") else mover_mod.FIRST_LEAD_BLOCKS
        with swapped(mover_mod, FIRST_CHUNKS_TOGETHER=k, FIRST_LEAD_BLOCKS=lead):
            _add_round(res, how, b, *_both_reps(b, reps, how == "sequential"))
    res["engine_default_first_chunks"] = mover_mod.FIRST_CHUNKS_TOGETHER
    res["engine_default_first_lead_blocks"] = mover_mod.FIRST_LEAD_BLOCKS
    return res


def _add_round(res: dict, key: str, b: mb.Bench, walls: list[float], marks: list[dict]) -> None:
    """One round of ``_both_reps`` into ``res[key]``: its aggregate GB/s, its walls, and the median
    of each phase mark (one dict per round)."""
    r = res.setdefault(key, {"GBps": [], "walls_ms": [], "marks_us_median": []})
    r["GBps"].append(2 * b.bytes / statistics.median(walls) / GB)
    r["walls_ms"] += [1e3 * w for w in walls]
    r["marks_us_median"].append({k: statistics.median(m[k] for m in marks) for k in marks[0]})


def _both_reps(b: mb.Bench, reps: int, sequential: bool) -> tuple[list[float], list[dict]]:
    e = b.e
    walls, marks = [], []
    for _ in range(reps):
        b.run(b.mv("evict", "device", "host", b.A))
        torch.cuda.synchronize()
        out_cmd, in_cmd = b.mv("evict", "device", "host", b.B), b.mv("restore", "host", "device", b.A)
        t0 = time.perf_counter_ns()
        if sequential:
            t_out = e.submit(out_cmd)
            t_in = e.submit(in_cmd)
        else:
            t_out, t_in = e.submit_many([out_cmd, in_cmd])
        po = dict(e._inflight[out_cmd.move_id].phases)
        pi = dict(e._inflight[in_cmd.move_id].phases)
        e.wait(t_in), e.wait(t_out)
        walls.append((time.perf_counter_ns() - t0) / 1e9)
        marks.append({f"spill.{k}": (v - t0) / 1e3 for k, v in po.items()}
                     | {f"restore.{k}": (v - t0) / 1e3 for k, v in pi.items()})
        b.run(b.mv("restore", "host", "device", b.B))
    return walls, marks


def dma_issue_cost(b: mb.Bench, reps: int) -> dict:
    """Host µs to enqueue 64 scattered 2 MiB device->host DMAs, one run each: through torch
    (``TorchDma``: copy_ on slices), through ``RawDma`` one cudaMemcpyAsync per run (``raw``) and
    in one cudaMemcpyBatchAsync (``batch``, where the runtime has it); the bytes are compared."""
    e = b.e
    dp, s = e.device_pool, e.ctx.streams
    issuers = _issuers()
    runs = [(sl, k, 1) for k, sl in enumerate(dp.slots_of(b.B[:64]))]
    h = b.h_b.tensor
    out: dict = {"raw_found": "raw" in issuers, "batch_found": "batch" in issuers}
    out.update({f"{name}_us": [] for name in issuers})
    if "raw" not in issuers:
        return out
    ref = None
    for _ in range(reps):
        for name, issuer in issuers.items():
            h[:64].zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            with torch.cuda.stream(s.d2h):
                issuer.copy_runs(s.d2h, h, dp.words, runs)
            out[f"{name}_us"].append((time.perf_counter_ns() - t0) / 1e3)
            torch.cuda.synchronize()
            got = h[:64].clone()
            ref = got if ref is None else ref
            out["same_bytes"] = bool(torch.equal(ref, got)) and out.get("same_bytes", True)
    for name in issuers:
        out[f"{name}_us_median"] = statistics.median(out[f"{name}_us"])
    return out


def _issuers() -> dict:
    """torch, and where the runtime is found raw (one call per run) and batch (one per call)."""
    from residency.dataplane.moves.dma import RawDma, TorchDma

    out: dict = {"torch": TorchDma()}
    one_by_one, batched = RawDma.load(batch=False), RawDma.load()
    if one_by_one is not None:
        out["raw"] = one_by_one
    if batched is not None and batched.batch_refused is None:
        out["batch"] = batched
    return out


def both_dma(b: mb.Bench, reps: int) -> dict:
    """Spill+restore through submit_many (the mover's default first chunks) with the mover's
    DMAs issued each way of ``_issuers`` (torch, one cudaMemcpyAsync per run, one batch per call),
    two interleaved rounds each."""
    issuers = _issuers()
    res: dict = {"raw_found": "raw" in issuers, "batch_found": "batch" in issuers}
    if "raw" not in issuers:
        return res
    for name, issuer in list(issuers.items()) * 2:
        with swapped(b.e.ctx, dma=issuer):
            _add_round(res, name, b, *_both_reps(b, reps, False))
    return res


def main(argv=None) -> int:
    args = _args(argv)
    got = mb.gpu_bench("moves_probe", args)
    if got is None:
        return 2
    b, res = got
    res["errors"] = {}
    try:
        b.e.ctx.copy_modes.update(d2h="staged", h2d="staged")
        for _ in range(2):
            b.run(b.mv("evict", "device", "host", b.A))
            b.run(b.mv("restore", "host", "device", b.A))
        b.ceiling()
        res.update({k: v for k, v in b.res.items() if k.startswith("ceiling")})
        import gc

        gc.collect()
        gc.freeze()                                          # as bench/moves.py does
        sections = {"both": lambda: both(b, args.reps), "dma_issue": lambda: dma_issue_cost(b, args.reps),
                    "both_dma": lambda: both_dma(b, args.reps),
                    "copy_paths": lambda: copy_paths(b, args.reps), "host": lambda: host_profile(b),
                    "one_block": lambda: one_block_profile(b)}
        for name in args.sections.split(","):
            fn = sections[name]
            try:
                res[name] = fn()
                if name not in ("host", "one_block"):
                    print(name, json.dumps(res[name], indent=1))
            except Exception as ex:  # noqa: BLE001 - keep the other sections
                res["errors"][name] = repr(ex)
                print(f"section {name} failed: {ex!r}", file=sys.stderr)
    finally:
        b.close()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
