"""Flip as a serving worker runs it: two random-weight models of different sizes (one KV page
shape) behind the worker core ``residency serve`` builds, driven with the control's commands.

    python bench/flip_serve.py --device cuda --out $OUT/flip-serve.json
    python bench/flip_serve.py --device cpu --scale 16          # small, any host

Per SwapWeights: bytes each way, wall time, overlap (by the schedule, and seen on the device),
the driver's free memory after less before (``measured_freed_bytes``: a level-1 sleep should give
back the arena and the decode graphs, a wake take them again), and whether greedy output is the
same token for token after 3 A→B→A cycles and each sleep/wake. Time to first token after a wake
is put beside a cold start of the same model (a new worker core built from its file).
Targets: sleep frees at least the arena; every output identical; pinned bytes back where they started.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from commit import git_commit  # noqa: E402

from residency.dataplane.faults import WorkerFaults  # noqa: E402
from residency.dataplane.model import ModelConfig, random_model  # noqa: E402
from residency.dataplane.proc import arg_parser  # noqa: E402
from residency.dataplane.serving_worker import build_serving_core  # noqa: E402
from residency.events.commands import Generate, SamplingParams, SwapWeights, TokensGenerated  # noqa: E402


def shape(name: str, hidden: int, inter: int, scale: int) -> ModelConfig:
    # 16 layers, 8 KV heads of 128: the page shape both share; hidden and MLP width differ
    return ModelConfig(name=name, num_layers=16, hidden=hidden // scale, num_heads=max(8, 16 // scale) if scale > 1
                       else hidden // 128, num_kv_heads=8, head_dim=128 // scale if scale > 1 else 128,
                       intermediate=inter // scale, vocab_size=32000 // scale, rope_theta=500000.0,
                       rope_scaling=None, rms_eps=1e-5, max_position=4096, tie_embeddings=False)


def write(path: str, cfg: ModelConfig, device: str, seed: int) -> None:
    from residency.dataplane.model.loader import save_hf_dir
    from tests.model.helpers_model import CHATML, tiny_tokenizer_json

    model = random_model(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=seed)
    save_hf_dir(model, path, tokenizer_json=tiny_tokenizer_json(cfg.vocab_size))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def build(run_dir: str, device: str, models: list[str]):
    argv = ["--worker", "0", "--control", "ipc:///unused", "--run-dir", run_dir, "--device", device,
            "--device-blocks", "512", "--host-bytes", str(64 << 20), "--no-disk-fsync"]
    for m in models:
        argv += ["--model", m]
    argv += ["--flip-host-copies", "off"]     # the rotation is what this measures
    return build_serving_core(arg_parser().parse_args(argv), WorkerFaults(""))[0]


def greedy(core, rid: str, model: str = "") -> tuple[list[int], float]:
    """(tokens, seconds to the first one) of a 16-token greedy request."""
    t0 = time.perf_counter()
    out = core.run(Generate(request_id=rid, session=None, token_ids=list(range(5, 69)), block_ids=list(range(1, 7)),
                            num_cached_tokens=0, sampling=SamplingParams(max_tokens=16, temperature=0.0),
                            free_on_finish=True, model=model))
    ttft, tokens = None, []
    while core.serving.has_work():
        for o in core.serving.step():
            if isinstance(o, TokensGenerated) and o.request_id == rid:
                if o.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += o.token_ids
                if o.error:
                    raise RuntimeError(o.error)
    return tokens, ttft


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=1, help="divide every width by this (CPU: 16)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="flip-serve-")
    big, small = shape("big", 2048, 8192, args.scale), shape("small", 1024, 4096, args.scale)
    t0 = time.perf_counter()
    for name, cfg, seed in (("big", big, 1), ("small", small, 2)):
        write(os.path.join(work, name), cfg, args.device, seed)
    print(f"models written in {time.perf_counter() - t0:.1f} s", flush=True)
    core = build(os.path.join(work, "run"), args.device, [f"big={work}/big", f"small={work}/small"])
    swapper = core.handlers[SwapWeights].__self__
    pinned0 = core.mover.pinned.in_use_bytes
    rows, gen = [], 0

    def swap(action: str, to_model: str = "", level: int = 1) -> dict:
        nonlocal gen
        gen += 1
        (r,) = core.run(SwapWeights(flip_id=f"{action}-{gen}", action=action, to_model=to_model, level=level,
                                    to_gen=gen))
        if r.error:
            raise RuntimeError(r.error)
        flip = swapper.last_flip if action == "flip" else None
        seen = flip.overlapped_steps_seen if flip else None
        row = {"action": action, "level": level if action == "sleep" else None, "to": r.resident or "-",
               "bytes_out": r.bytes_out, "bytes_in": r.bytes_in, "dropped_bytes": r.dropped_bytes,
               "wall_s": (r.finished_ns - r.started_ns) / 1e9, "rotation_s": flip.wall_s if flip else None,
               "out_s": r.out_ns / 1e9, "in_s": r.in_ns / 1e9,
               "steps": r.steps, "overlapped_steps": r.overlapped_steps, "overlapped_steps_seen": seen,
               "measured_freed_bytes": r.measured_freed_bytes, "checksum_ok": r.checksum_ok}
        rows.append(row)
        return row

    a0, _ = greedy(core, "a0")
    same = []
    for cycle in range(3):
        swap("flip", "small")
        b, _ = greedy(core, f"b{cycle}", "small")
        same.append(("small", cycle, b == (b0 := b if cycle == 0 else b0)))
        swap("flip", "big")
        same.append(("big", cycle, greedy(core, f"a{cycle}", "big")[0] == a0))
    wake_ttft = {}
    for level in (1, 2):
        swap("sleep", level=level)
        swap("wake")
        tokens, wake_ttft[level] = greedy(core, f"w{level}")
        same.append((f"wake{level}", 0, tokens == a0))
    pinned_back = core.mover.pinned.in_use_bytes == pinned0
    arena = swapper.arena.capacity_bytes
    core.close()
    del core, swapper
    if args.device == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    cold = build(os.path.join(work, "cold"), args.device, [f"big={work}/big"])
    build_s = time.perf_counter() - t0
    cold_tokens, cold_ttft = greedy(cold, "cold")
    cold.close()
    # wall: the whole command (checksums, graph capture); GB/s: the rotation's copies alone (flips)
    print(f"\n{'action':<8}{'to':<7}{'out MB':>9}{'in MB':>9}{'wall s':>9}{'GB/s':>8}{'ovl':>6}{'seen':>6}"
          f"{'freed MB':>11}")
    for r in rows:
        moved = r["bytes_out"] + r["bytes_in"]
        copy_s = r["rotation_s"] or r["out_s"] + r["in_s"]
        print(f"{r['action'] + (str(r['level']) if r['level'] else ''):<8}{r['to']:<7}{r['bytes_out'] / 1e6:>9.1f}"
              f"{r['bytes_in'] / 1e6:>9.1f}{r['wall_s']:>9.3f}{(moved / copy_s / 1e9 if copy_s else 0.0):>8.2f}"
              f"{r['overlapped_steps']:>6}{str(r['overlapped_steps_seen']):>6}"
              f"{(r['measured_freed_bytes'] / 1e6 if r['measured_freed_bytes'] is not None else float('nan')):>11.1f}")
    print(f"\nttft after wake: level 1 {wake_ttft[1]:.3f} s, level 2 {wake_ttft[2]:.3f} s; cold start "
          f"{build_s:.2f} s to build + {cold_ttft:.3f} s ttft; identical outputs: {all(s for *_, s in same)}; "
          f"cold start same tokens: {cold_tokens == a0}; pinned back: {pinned_back}")
    sleeps = [r for r in rows if r["action"] == "sleep" and r["level"] == 1]
    freed_ok = all(r["measured_freed_bytes"] is not None and r["measured_freed_bytes"] >= arena for r in sleeps)
    machine = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0)
    res = {"bench": "flip_serve", "date": dt.date.today().isoformat(), "machine": machine,
           "git_commit": git_commit(("dataplane", "bench/flip_serve.py")), "torch": torch.__version__,
           "config": {"scale": args.scale, "arena_bytes": arena, "big": str(big), "small": str(small)},
           "swaps": rows, "identical": same, "wake_ttft_s": wake_ttft, "cold_build_s": build_s,
           "cold_ttft_s": cold_ttft, "pinned_back": pinned_back,
           "targets": {"sleep_frees_the_arena": {"measured": [r["measured_freed_bytes"] for r in sleeps],
                                                 "target": arena, "met": freed_ok},
                       "outputs_identical": {"met": all(s for *_, s in same) and cold_tokens == a0},
                       "pinned_back": {"met": pinned_back}}}
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"flip-serve-{res['date']}-{args.device}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
