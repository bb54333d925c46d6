"""Flip: swap the device weights arena between two Llama-3-8B-shaped bf16 images, against the link.

    python bench/flip.py --device cuda                          # two ~16 GiB images (the issue's case)
    python bench/flip.py --device cpu --image-gib 0.02 --dim-scale 16   # small, any host
    python bench/flip.py --device cuda --out bench/results/flip-<date>-<machine>.json

The arena holds image A, a pinned host slab holds image B plus the rotation's overshoot (the ring:
--ring-depth chunks of --chunk-mib), so host memory is one image plus the overshoot. Measured in one
run, rounds interleaved so the link's drift hits every approach alike:
  flip        RotationExecutor.flip(): bytes out + bytes in over the rotation's wall time (the
              checksums before and after are timed apart); the priming flip (first use of the
              streams and the checksum kernel) is reported apart from the steady state
  duplex      a plain concurrent D2H + H2D of the same sizes on two streams between separate
              buffers (no aliasing, nothing to order): the link's aggregate for this run
  sequential  all out, then all in (what a flip without a ring does with a second host image)
  reload      the incoming image read from its safetensors file (written to local disk first;
              the file was just written, so the page cache is warm and the figure is a ceiling)
Target: steady flip bandwidth >= 90% of the duplex aggregate (``targets.flip_vs_duplex``).
Random weights, never zeros; every flip is verified by checksum on both sides.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commit import git_commit  # noqa: E402
from moves_report import device_name  # noqa: E402

from residency.dataplane.flip.arena import WeightsArena  # noqa: E402
from residency.dataplane.flip.image import Manifest, image_checksums  # noqa: E402
from residency.dataplane.flip.rotation import RotationExecutor  # noqa: E402
from residency.dataplane.flip.slab import HostSlab  # noqa: E402
from residency.dataplane.pools.budget import PinnedBudget  # noqa: E402

GB = 1e9
GiB = 1 << 30


def llama3_8b_specs(image_gib: float, scale: int):
    """Llama-3-8B tensor shapes (dims divided by ``scale``), with as many layers as fit ``image_gib``
    (32 layers at scale 1 are 14.96 GiB; 16 GiB gives 34)."""
    h, kv, inter, vocab = 4096 // scale, 1024 // scale, 14336 // scale, 128256 // scale
    bf = torch.bfloat16
    layer = [("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
             ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
             ("mlp.gate_proj.weight", (inter, h)), ("mlp.up_proj.weight", (inter, h)),
             ("mlp.down_proj.weight", (h, inter)), ("input_layernorm.weight", (h,)),
             ("post_attention_layernorm.weight", (h,))]
    per_layer = sum(2 * _numel(s) for _, s in layer)
    ends = 2 * (2 * vocab * h) + 2 * h
    layers = max(1, int((image_gib * GiB - ends) // per_layer))
    specs = [("model.embed_tokens.weight", (vocab, h), bf)]
    for i in range(layers):
        specs += [(f"model.layers.{i}.{n}", s, bf) for n, s in layer]
    specs += [("model.norm.weight", (h,), bf), ("lm_head.weight", (vocab, h), bf)]
    return specs, layers


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def fill_random(buf: torch.Tensor, seed: int) -> None:
    """Random bytes (never zeros) into a flat uint8 buffer, 256 MiB at a time."""
    g = torch.Generator(device=buf.device).manual_seed(seed)
    step = 256 << 20
    for lo in range(0, buf.numel(), step):
        part = buf[lo: lo + step]
        part.copy_(torch.randint(1, 256, (part.numel(),), dtype=torch.uint8, device=buf.device, generator=g))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def duplex(dev, d_src, h_dst, h_src, d_dst) -> float:
    """One D2H and one H2D of the same sizes at once on two streams, separate buffers: seconds."""
    sync(dev)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        with torch.cuda.stream(s1):
            h_dst.copy_(d_src, non_blocking=True)
        with torch.cuda.stream(s2):
            d_dst.copy_(h_src, non_blocking=True)
    else:
        h_dst.copy_(d_src)
        d_dst.copy_(h_src)
    sync(dev)
    return time.perf_counter() - t0


def sequential(dev, d_src, h_dst, h_src, d_dst) -> float:
    sync(dev)
    t0 = time.perf_counter()
    h_dst.copy_(d_src, non_blocking=True)
    sync(dev)
    d_dst.copy_(h_src, non_blocking=True)
    sync(dev)
    return time.perf_counter() - t0


def reload_from_safetensors(dev, path: str, manifest: Manifest, d_dst: torch.Tensor) -> float:
    from safetensors import safe_open

    views = manifest.views(d_dst)
    sync(dev)
    t0 = time.perf_counter()
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            views[name].copy_(f.get_tensor(name))
    sync(dev)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--image-gib", type=float, default=None, help="size of each image (default 16 on cuda, 0.02 on cpu)")
    ap.add_argument("--dim-scale", type=int, default=None, help="divide Llama-3-8B's dims (default 1 on cuda, 16 on cpu)")
    ap.add_argument("--chunk-mib", type=float, default=None, help="rotation chunk (default 64 on cuda, 1 on cpu)")
    ap.add_argument("--checksum-chunk-mib", type=float, default=64.0)
    ap.add_argument("--ring-depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="steady rounds: flip A->B and back, duplex, sequential")
    ap.add_argument("--no-reload", action="store_true", help="skip the safetensors reload")
    ap.add_argument("--tmp-dir", default=None, help="where the safetensors file is written (local disk)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    gib = args.image_gib if args.image_gib is not None else (16.0 if cuda else 0.02)
    scale = args.dim_scale if args.dim_scale is not None else (1 if cuda else 16)
    chunk = int((args.chunk_mib or (64.0 if cuda else 1.0)) * (1 << 20)) // 256 * 256
    sum_chunk = int(args.checksum_chunk_mib * (1 << 20)) // 256 * 256
    specs, layers = llama3_8b_specs(gib, scale)
    m = Manifest.of_specs(specs)
    n = m.nbytes
    slab_bytes = HostSlab.capacity_for([n, n], chunk, args.ring_depth)
    # pinned: the slab (one image + overshoot) and the baselines' second host buffer
    budget = PinnedBudget(slab_bytes + n + (64 << 20), pin=cuda)
    print(f"images: 2 x {n / GiB:.2f} GiB ({layers} layers, dims /{scale}), chunk {chunk >> 20} MiB, "
          f"ring {args.ring_depth}, slab {slab_bytes / GiB:.2f} GiB, device {device_name(dev)}", flush=True)

    arena = WeightsArena(n, dev)
    slab = HostSlab(budget, slab_bytes)
    fill_random(arena.buffer, seed=2)                       # image B, made on the device
    slab.store("B", m, arena.buffer[:n], offset=0, chunk_bytes=sum_chunk)
    fill_random(arena.buffer, seed=1)                       # image A, in place
    arena.adopt("A", m, chunk_bytes=sum_chunk)
    ex = RotationExecutor(arena, slab, chunk, args.ring_depth)
    host_x = budget.alloc("bench-baseline-host", (n,), torch.uint8).tensor
    dev_y = torch.empty(n, dtype=torch.uint8, device=dev)
    fill_random(host_x, seed=3) if not cuda else host_x.copy_(arena.buffer)
    pinned_before = budget.in_use_bytes
    alloc_before = torch.cuda.memory_allocated(dev) if cuda else None

    def flip_row(r):
        return {"GBps": (r.bytes_out + r.bytes_in) / r.wall_s / GB, "wall_s": r.wall_s, "bytes_out": r.bytes_out,
                "bytes_in": r.bytes_in, "d2h_s": r.d2h_s, "h2d_s": r.h2d_s, "steps": r.steps,
                "overlapped_steps": r.overlapped_steps, "overlapped_steps_seen": r.overlapped_steps_seen,
                "verify_before_s": r.verify_before_s, "verify_after_s": r.verify_after_s,
                "checksum_ok": r.checksum_ok, "forward": r.forward,
                "GBps_with_checksums": (r.bytes_out + r.bytes_in) / (r.wall_s + r.verify_before_s + r.verify_after_s) / GB}

    priming = flip_row(ex.flip())
    print(f"priming flip: {priming['GBps']:.1f} GB/s", flush=True)
    flips, dup, seq = [], [], []
    for _ in range(args.rounds):
        for _ in range(2):                                  # A->B and back: both directions of the slab
            flips.append(flip_row(ex.flip()))
        dup.append(2 * n / duplex(dev, arena.buffer, host_x, slab.image_bytes(), dev_y) / GB)
        seq.append(2 * n / sequential(dev, arena.buffer, host_x, slab.image_bytes(), dev_y) / GB)
        print(f"round: flip {flips[-2]['GBps']:.1f} / {flips[-1]['GBps']:.1f}, duplex {dup[-1]:.1f}, "
              f"sequential {seq[-1]:.1f} GB/s", flush=True)
    leak = {"pinned_in_use_equal": budget.in_use_bytes == pinned_before,
            "device_allocated_equal": (torch.cuda.memory_allocated(dev) == alloc_before) if cuda else None}

    reload = None
    if not args.no_reload:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
            path = os.path.join(tmp, "incoming.safetensors")
            t0 = time.perf_counter()
            save_file({k: v for k, v in slab.image.manifest.views(slab.bytes, slab.offset).items()}, path)
            write_s = time.perf_counter() - t0
            secs = [reload_from_safetensors(dev, path, slab.image.manifest, dev_y) for _ in range(2)]
            reload = {"GBps": n / min(secs) / GB, "seconds": secs, "write_s": write_s,
                      "page_cache": "warm (the file was written in this run)",
                      "checksum_ok": image_checksums(dev_y, sum_chunk) == slab.image.sums}
        print(f"reload from safetensors: {reload['GBps']:.1f} GB/s (write {write_s:.1f} s)", flush=True)

    steady = {k: statistics.median(f[k] for f in flips) for k in ("GBps", "GBps_with_checksums", "wall_s", "d2h_s",
                                                                  "h2d_s", "verify_before_s", "verify_after_s")}
    steady["overlapped_steps"] = flips[-1]["overlapped_steps"]
    steady["overlapped_steps_seen"] = flips[-1]["overlapped_steps_seen"]
    steady["steps"] = flips[-1]["steps"]
    steady["checksum_ok_all"] = all(f["checksum_ok"] for f in flips) and priming["checksum_ok"]
    duplex_gbps, seq_gbps = statistics.median(dup), statistics.median(seq)
    ratio = steady["GBps"] / duplex_gbps
    rows = [("flip (priming)", priming["GBps"]), ("flip (steady, median)", steady["GBps"]),
            ("flip incl. checksums", steady["GBps_with_checksums"]), ("duplex aggregate", duplex_gbps),
            ("sequential (out, then in)", seq_gbps)] + ([("reload from safetensors (in only)", reload["GBps"])]
                                                        if reload else [])
    print(f"\n{'approach':<36}{'GB/s':>10}{'vs duplex':>12}")
    for name, v in rows:
        print(f"{name:<36}{v:>10.2f}{v / duplex_gbps:>12.3f}")
    print(f"\nflip/duplex {ratio:.3f} (target 0.9); overlapped steps {steady['overlapped_steps']}/{steady['steps']} "
          f"(seen running: {steady['overlapped_steps_seen']}); leak check {leak}")
    machine = "cpu" if not cuda else ("h200" if "H200" in torch.cuda.get_device_name(dev) else
                                      "h100" if "H100" in torch.cuda.get_device_name(dev) else "gpu")
    res = {
        "bench": "flip", "date": dt.date.today().isoformat(), "machine": machine, "device": device_name(dev),
        "git_commit": git_commit(("dataplane/flip", "bench/flip.py")), "torch": torch.__version__,
        "config": {"image_bytes": n, "layers": layers, "dim_scale": scale, "chunk_bytes": chunk,
                   "checksum_chunk_bytes": sum_chunk, "ring_depth": args.ring_depth, "slab_bytes": slab_bytes,
                   "rounds": args.rounds, "pinned_host_bytes": budget.in_use_bytes},
        "priming": priming, "steady": steady, "flips": flips,
        "duplex_GBps": duplex_gbps, "duplex_runs_GBps": dup, "sequential_GBps": seq_gbps, "sequential_runs_GBps": seq,
        "reload": reload, "leak_check": leak,
        "targets": {"flip_vs_duplex": {"measured": round(ratio, 4), "target": 0.9, "met": ratio >= 0.9}},
    }
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"flip-{res['date']}-{machine}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
