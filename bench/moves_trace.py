"""Where a 2 GiB move's time goes, on the device's own clock: torch.profiler around single moves.

bench/moves.py says how fast a move is; this says why. It runs the same mover and blocks as
bench/moves.py (1024 scattered 2 MiB blocks), warms up, then profiles one of each:

    spill            evict A device -> host (checksums; copy modes: --copy-modes, default the mover's)
    restore          restore A host -> device (verified)
    restore_nohash   the same without hashing (bench/moves.py's no_checksums)
    both             spill B and restore A submitted one after the other (two submits)
    both_many        the same through Mover.submit_many (first chunks in turn, by slices)
    bare_both        no engine: one contiguous 2 GiB copy each way, each on its own stream, at once
                     (which direction the link itself favours when both run)

and prints, per move, on one timeline starting at the host's call: when the first DMA started,
how long the DMAs were busy, the gaps between them (the link idle inside the move), when the last
DMA and the last kernel ended, and when the host returned. Chrome traces go to --trace-dir.

    python3 bench/moves_trace.py [--out trace.json] [--trace-dir DIR] [--copy-modes default|dma|staged|kernel]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import moves as mb  # noqa: E402  (bench/moves.py: the same mover set-up)


def _args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--pipeline-blocks", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--tail-ms", type=float, default=0.0,
                   help="list every device event and CUDA call in each move's last this many ms")
    p.add_argument("--only", default=None, help="comma-separated moves to trace (default: all)")
    p.add_argument("--copy-modes", default="default",
                   help="the mover's copy mode for both directions, or 'default' (the mover's own)")
    a = p.parse_args(argv)
    # the fields bench/moves.py's Bench reads
    a.layers, a.page_tokens, a.kv_heads, a.head_dim = 32, 16, 8, 128
    a.reps, a.latency_iters, a.chunk_blocks, a.matmuls, a.seed, a.cpu, a.quick = 1, 1, 128, 1, 1, False, False
    return a


def _tail(evs, t0: float, t1: float, ms: float) -> list:
    """Every device event and CUDA host call that ends in the last ``ms`` of [t0, t1]: what runs
    between a move's last byte and its return. Rows: (start µs, end µs, "dev"/"host", stream or
    thread, name), relative to t0."""
    rows = []
    for e in evs:
        end = e.time_range.end
        if not (t1 - ms * 1e3 <= end <= t1 and e.time_range.start >= t0):
            continue
        if e.device_type == DeviceType.CUDA:
            where = f"dev s{getattr(e, 'device_resource_id', '?')}"
        elif e.name.startswith("cu"):
            where = "host"
        else:
            continue
        rows.append((round(e.time_range.start - t0, 1), round(end - t0, 1), where, e.name[:48]))
    return sorted(rows)


def _summary(prof, label: str, tail_ms: float = 0.0) -> dict:
    """The move's device activity relative to the host range named ``label``."""
    evs = prof.events()
    host = [e for e in evs if e.name == label and e.device_type == DeviceType.CPU]
    t0, t1 = host[0].time_range.start, host[0].time_range.end
    dev = sorted((e for e in evs if e.device_type == DeviceType.CUDA
                  and t0 <= e.time_range.start <= t1),
                 key=lambda e: e.time_range.start)
    dmas = [e for e in dev if e.name.startswith("Memcpy")]
    names = sorted({e.name for e in dmas})
    kernels = [e for e in dev if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    out: dict = {"host_us": round(t1 - t0, 1), "dmas": len(dmas), "dma_names": names[:4], "kernels": len(kernels)}
    for name, group in (("d2h", [e for e in dmas if "DtoH" in e.name]), ("h2d", [e for e in dmas if "HtoD" in e.name])):
        if not group:
            continue
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(group, group[1:])]
        out[name] = {
            "first_start_us": round(group[0].time_range.start - t0, 1),
            "last_end_us": round(group[-1].time_range.end - t0, 1),
            "busy_us": round(sum(e.time_range.end - e.time_range.start for e in group), 1),
            "n": len(group),
            "gap_sum_us": round(sum(g for g in gaps if g > 0), 1),
            "largest_gaps_us": sorted((round(g, 1) for g in gaps), reverse=True)[:5],
        }
    if kernels:
        out["last_kernel_end_us"] = round(max(e.time_range.end for e in kernels) - t0, 1)
        by: dict[str, list[float]] = {}
        for e in kernels:
            by.setdefault(e.name[:40], []).append(e.time_range.end - e.time_range.start)
        out["kernels_us"] = {k: [len(v), round(sum(v), 1)] for k, v in by.items()}
    launches = [e for e in evs if e.device_type == DeviceType.CPU and t0 <= e.time_range.start <= t1
                and e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                               "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventSynchronize",
                               "cudaEventQuery", "cudaMemcpyBatchAsync", "cudaStreamSynchronize")]
    calls: dict[str, list[float]] = {}
    for e in launches:
        calls.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    out["host_calls_us"] = {k: [len(v), round(sum(v), 1)] for k, v in calls.items()}
    if tail_ms:
        out["tail"] = _tail(evs, t0, t1, tail_ms)
    return out


def main(argv=None) -> int:
    args = _args(argv)
    got = mb.gpu_bench("moves_trace", args, " (the device's clock is the point)")
    if got is None:
        return 2
    b, res = got
    res["moves"] = {}
    try:
        e = b.e
        if args.copy_modes != "default":
            e.ctx.copy_modes.update(d2h=args.copy_modes, h2d=args.copy_modes)
        res["copy_modes"] = dict(e.ctx.copy_modes)
        for _ in range(2):                                   # warm: compile, caches, allocator
            b.run(b.mv("evict", "device", "host", b.A))
            b.run(b.mv("restore", "host", "device", b.A))

        # Each step moves A out and back (or B out and back), so a step can run twice: the profiler
        # warms up on the first (its own buffer set-up costs ms of host time) and records the second.
        ph: dict = {}

        def spill():
            cmd = b.mv("evict", "device", "host", b.A)
            with torch.profiler.record_function("spill"):
                b.run(cmd)
            ph["spill"] = mb.phases(e.last_phases)
            b.run(b.mv("restore", "host", "device", b.A))

        def restore():
            b.run(b.mv("evict", "device", "host", b.A))
            torch.cuda.synchronize()
            cmd = b.mv("restore", "host", "device", b.A)
            with torch.profiler.record_function("restore"):
                b.run(cmd)
            ph["restore"] = mb.phases(e.last_phases)

        def restore_nohash():
            with mb.no_checksums():
                b.run(b.mv("evict", "device", "host", b.A))
            torch.cuda.synchronize()
            cmd = b.mv("restore", "host", "device", b.A)
            with mb.no_checksums(), torch.profiler.record_function("restore_nohash"):
                b.run(cmd)
            ph["restore_nohash"] = mb.phases(e.last_phases)

        def both():
            b.run(b.mv("evict", "device", "host", b.A))
            torch.cuda.synchronize()
            out_cmd, in_cmd = b.mv("evict", "device", "host", b.B), b.mv("restore", "host", "device", b.A)
            with torch.profiler.record_function("both"):
                t_out = e.submit(out_cmd)
                t_in = e.submit(in_cmd)
                e.wait(t_in), e.wait(t_out)
            ph["both"] = mb.phases(e.last_phases)
            b.run(b.mv("restore", "host", "device", b.B))

        def both_many():
            b.run(b.mv("evict", "device", "host", b.A))
            torch.cuda.synchronize()
            out_cmd, in_cmd = b.mv("evict", "device", "host", b.B), b.mv("restore", "host", "device", b.A)
            with torch.profiler.record_function("both_many"):
                t_out, t_in = e.submit_many([out_cmd, in_cmd])
                e.wait(t_in), e.wait(t_out)
            ph["both_many"] = mb.phases(e.last_phases)
            b.run(b.mv("restore", "host", "device", b.B))

        side = (torch.cuda.Stream(), torch.cuda.Stream())

        def bare_both():
            torch.cuda.synchronize()
            with torch.profiler.record_function("bare_both"):
                for st in side:
                    st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side[0]):
                    b.h_b.tensor.copy_(b.d_a, non_blocking=True)
                with torch.cuda.stream(side[1]):
                    b.d_b.copy_(b.h_a.tensor, non_blocking=True)
                torch.cuda.synchronize()

        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        for label, fn in (("spill", spill), ("restore", restore), ("restore_nohash", restore_nohash), ("both", both),
                          ("both_many", both_many), ("bare_both", bare_both)):
            if args.only and label not in args.only.split(","):
                continue
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=acts, schedule=sched) as prof:
                for _ in range(2):
                    fn()
                    torch.cuda.synchronize()
                    prof.step()
            s = _summary(prof, label, args.tail_ms)
            s["phases_us"] = ph.get(label)
            res["moves"][label] = s
            print(label, json.dumps(s))
            if args.trace_dir:
                prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace-{label}.json"))
    finally:
        b.close()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
