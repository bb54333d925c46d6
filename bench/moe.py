#!/usr/bin/env python3
"""MoE decode bench: OLMoE-1B-7B-shaped random weights, tokens/s as a fraction of the roofline.

    python bench/moe.py --gpu [--out DIR]    # OLMoE-1B-7B shape, bfloat16, on the GPU
    python bench/moe.py --cpu [--out DIR]    # a tiny OLMoE shape on this host's CPU (the flow only)
    python bench/moe.py --gpu --offload      # experts in pinned host memory, device budgets 100/50/25%
                                             # (bench/moe_offload.py), beside the all-resident runner

At batch b a decode step must read, per layer, the attention weights, the router and every
expert at least one of the b tokens routed to (not all 64: the point of a MoE), plus each
sequence's K/V; once the LM head. So

    roofline_time = (attention + router + Σ_layers experts_hit · expert_bytes + lm_head
                     + Σ_seqs context · kv_bytes_per_token) / bandwidth

with experts_hit counted from the routing of the very steps measured (an instrumented pass over
the same states) and the bandwidth measured in the same run (a device copy, read + write counted).
Three engines decode the same prompts side by side:
  fused        the runner with ``kernels.moe.fused_moe`` (one grouped GEMM launch per projection);
               on the GPU also replayed as CUDA graphs (``DecodeGraphs``, no launch cost)
  loop         the same runner with the MoE MLP as a loop of dense matmuls over the hit experts
               (``fused_moe_ref``: what the fused kernel replaces)
  transformers ``OlmoeForCausalLM.generate`` over the same weights (views, no copy)
and one MoE layer alone (``fused_moe`` vs the loop) against its own roofline.
On the CPU ``fused_moe`` is the loop (the Triton kernel runs on CUDA), so only the flow is checked.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import residency.dataplane.model.runner as runner_mod  # noqa: E402
from residency.dataplane.model import random_model  # noqa: E402
from residency.dataplane.model.config import OLMOE_1B_7B, ModelConfig  # noqa: E402
from residency.dataplane.model.hf_reference import build_hf_llama  # noqa: E402
from residency.kernels.moe import fused_moe, fused_moe_ref, route  # noqa: E402

from commit import git_commit  # noqa: E402  (bench/commit.py)
from moe_decode import kv_pages, prefill, runner_step, timed_decode  # noqa: E402  (bench/moe_decode.py)
from serve_common import Timer, log  # noqa: E402

TINY = OLMOE_1B_7B.replace(name="tiny-olmoe", num_layers=2, hidden=128, num_heads=4, num_kv_heads=4, head_dim=32,
                           intermediate=64, vocab_size=512, num_experts=16, num_experts_per_tok=4)


def bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """GB/s of a device copy, read + write counted (as bench/serve_common.d2d_bandwidth)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    t = Timer(device)(lambda: b.copy_(a), repeat=10, warmup=3)
    return 2 * nbytes / t / 1e9


def elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_bytes_per_step(c: ModelConfig, dtype: torch.dtype) -> int:
    """Attention weights, norms and router of every layer, and the LM head: read whatever routes."""
    hd = c.head_dim
    per_layer = c.hidden * c.qkv_rows + c.num_heads * hd * c.hidden + 2 * c.hidden
    per_layer += (c.num_heads + c.num_kv_heads) * hd + c.num_experts * c.hidden
    return (c.num_layers * per_layer + c.vocab_size * c.hidden + c.hidden) * elem(dtype)


class RoutingCounter:
    """Wraps the runner's MoE call to count the distinct experts each layer's batch routes to."""

    def __init__(self, inner):
        self.inner, self.hits = inner, []

    def __call__(self, x, router, w_gate_up, w_down, top_k, renormalize, **kw):
        _, experts = route(x, router, top_k, renormalize)
        self.hits.append(int(torch.unique(experts).numel()))
        return self.inner(x, router, w_gate_up, w_down, top_k, renormalize, **kw)


def decode_run(model, prompts: list[list[int]], steps: int, moe_fn, timer: Timer):
    """Prefill every prompt, then ``steps`` greedy decode steps of the whole batch. Returns
    (seconds of the decode steps, tokens generated per sequence, experts hit per layer-step)."""
    runner = model.runner
    P = len(prompts[0])
    _, pool, tables = kv_pages(runner, len(prompts), P, steps)
    runner_mod.fused_moe = moe_fn
    try:
        out = prefill(runner, prompts, tables, pool)
        counter = RoutingCounter(moe_fn)
        runner_mod.fused_moe = counter                    # one instrumented step: routing of these states
        runner_step(runner, pool.clone(), tables, P)(0, out)
        runner_mod.fused_moe = moe_fn
        return timed_decode(runner_step(runner, pool, tables, P), out, steps, timer), out, counter.hits
    finally:
        runner_mod.fused_moe = fused_moe


def graph_decode_run(model, prompts: list[list[int]], steps: int, timer: Timer):
    """The fused engine replayed as one CUDA graph per step (``DecodeGraphs``, as the GPU serving
    path decodes): (seconds of the decode steps, tokens per sequence), or the capture's error."""
    import numpy as np

    from residency.dataplane.model.graphs import DecodeGraphs

    runner = model.runner
    b, P = len(prompts), len(prompts[0])
    per_seq, pool, tables = kv_pages(runner, b, P, steps)
    out = prefill(runner, prompts, tables, pool)
    try:
        graphs = DecodeGraphs(runner, pool, max_blocks_per_seq=per_seq, scratch_slot=0, batch_sizes=(b,))
    except Exception as e:  # noqa: BLE001 - reported in the result, the other engines still run
        return None, f"{type(e).__name__}: {e}"
    table_ids = np.array(tables, dtype=np.int32)

    def step(s, out):
        return graphs.step(np.array([o[-1] for o in out], dtype=np.int32), np.full(b, P + s, dtype=np.int64), table_ids)

    return timed_decode(step, out, steps, timer), out


def hf_decode_seconds(hf, prompts: list[list[int]], steps: int, timer: Timer) -> tuple[float, list[list[int]]]:
    """transformers' generate: (time of ``steps`` decode steps, i.e. generate(steps+1) − generate(1))."""
    ids = torch.tensor(prompts, device=hf.device)
    # an explicit all-ones mask: without it, generate takes every pad_token_id in a prompt for padding
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))

    def gen(n):
        timer.sync()
        t = time.perf_counter()
        with torch.no_grad():
            o = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        timer.sync()
        return time.perf_counter() - t, o

    gen(2)                                                  # warm-up
    t1, _ = gen(1)
    tn, o = gen(steps + 1)
    return max(tn - t1, 1e-9), o[:, ids.shape[1]:].tolist()


def layer_bench(model, b: int, bw: float, timer: Timer, gen: torch.Generator) -> dict:
    """One MoE layer alone at batch b: fused vs the loop, and the fused one against its roofline."""
    c, lw = model.config, model.runner.w.layers[0]
    x = torch.randn(b, c.hidden, generator=gen).to(model.runner.dtype).to(model.runner.device)
    args = (x, lw.router, lw.w_experts_gate_up, lw.w_experts_down, c.num_experts_per_tok, c.norm_topk_prob)
    hit = int(torch.unique(route(*args[:2], c.num_experts_per_tok, c.norm_topk_prob)[1]).numel())
    e = elem(model.runner.dtype)
    act = b * c.num_experts_per_tok * (2 * c.hidden + 3 * c.intermediate) * e * 2
    roof = (hit * c.expert_bytes(model.runner.dtype) + c.num_experts * c.hidden * e + act) / (bw * 1e9)
    t_fused = timer(lambda: fused_moe(*args), repeat=20, warmup=3)
    t_loop = timer(lambda: fused_moe_ref(*args), repeat=20, warmup=3)
    return {"batch": b, "experts_hit": hit, "fused_us": t_fused * 1e6, "loop_us": t_loop * 1e6,
            "roofline_us": roof * 1e6, "fused_fraction_of_roofline": roof / t_fused,
            "fused_speedup_over_loop": t_loop / t_fused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpu", action="store_true")
    g.add_argument("--cpu", action="store_true")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    ap.add_argument("--out", default=None, help="a directory (or .json path) for the result")
    ap.add_argument("--offload", action="store_true",
                    help="instead: decode with the experts offloaded at device budgets 100/50/25%% (bench/moe_offload.py)")
    ap.add_argument("--offload-batches", default="1,8")
    a = ap.parse_args()
    device = torch.device("cuda" if a.gpu else "cpu")
    cfg, dtype = (OLMOE_1B_7B, torch.bfloat16) if a.gpu else (TINY, torch.float32)
    P = a.prompt_tokens or (128 if a.gpu else 16)
    steps = a.steps or (32 if a.gpu else 4)
    batches = [int(x) for x in a.batches.split(",")]
    timer = Timer(device)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    machine = (torch.cuda.get_device_name().split()[1].lower() if a.gpu else "cpu")
    log(f"device {torch.cuda.get_device_name() if a.gpu else platform.processor() or 'cpu'}; {cfg.name} "
        f"{str(dtype)[6:]}, {cfg.num_params() / 1e9:.2f}B params, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}")
    bw = bandwidth_gbs(device, (1 << 30) if a.gpu else (64 << 20))
    log(f"measured copy bandwidth {bw:.0f} GB/s (read + write)")
    model = random_model(cfg, device=device, dtype=dtype, seed=0)
    if a.offload:
        return offload_main(a, model, cfg, dtype, device, P, steps, timer, gen, machine)
    hf = None if a.no_transformers else build_hf_llama(cfg, model.weights)
    kv_tok = cfg.kv_bytes_per_token(dtype)
    dense = dense_bytes_per_step(cfg, dtype)
    rows, layers = [], []
    for b in batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, P), generator=gen).tolist()
        decode_run(model, prompts, 2, fused_moe, timer)                     # warm-up (Triton compile)
        t_fused, toks, hits = decode_run(model, prompts, steps, fused_moe, timer)
        t_loop, toks_loop, _ = decode_run(model, prompts, steps, fused_moe_ref, timer)
        mean_hit = sum(hits) / len(hits)
        step_bytes = dense + sum(hits) * cfg.expert_bytes(dtype) + b * (P + steps // 2) * kv_tok
        roof = step_bytes / (bw * 1e9)
        row = {"batch": b, "prompt_tokens": P, "steps": steps, "experts_hit_per_layer": mean_hit,
               "step_bytes": step_bytes, "roofline_ms": roof * 1e3,
               "fused_tok_s": b * steps / t_fused, "fused_ms_per_step": t_fused / steps * 1e3,
               "fused_fraction_of_roofline": roof / (t_fused / steps),
               "loop_tok_s": b * steps / t_loop, "loop_fraction_of_roofline": roof / (t_loop / steps),
               "fused_equals_loop_tokens": toks == toks_loop}
        if a.gpu:
            t_graph, toks_graph = graph_decode_run(model, prompts, steps, timer)
            if t_graph is None:
                row["graphs_error"] = toks_graph
            else:
                row.update({"graphs_tok_s": b * steps / t_graph, "graphs_fraction_of_roofline": roof / (t_graph / steps),
                            "graphs_equal_fused_tokens": toks_graph == toks})
        if hf is not None:
            t_hf, toks_hf = hf_decode_seconds(hf, prompts, steps, timer)
            row.update({"transformers_tok_s": b * steps / t_hf,
                        "transformers_fraction_of_roofline": roof / (t_hf / steps),
                        # greedy agreement with transformers (bf16 may drift after a near-tie)
                        "tokens_equal_transformers": sum(x == y for r, rh in zip(toks, toks_hf)
                                                         for x, y in zip(r, rh)) / (b * (steps + 1))})
        rows.append(row)
        layers.append(layer_bench(model, b, bw, timer, gen))
        log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    log("")
    log(f"{'batch':>5} {'experts/layer':>13} {'roofline ms':>11} {'fused tok/s':>11} {'frac':>5} "
        f"{'loop tok/s':>10} {'frac':>5} {'hf tok/s':>9} {'frac':>5}")
    for r in rows:
        log(f"{r['batch']:>5} {r['experts_hit_per_layer']:>13.1f} {r['roofline_ms']:>11.3f} {r['fused_tok_s']:>11.1f} "
            f"{r['fused_fraction_of_roofline']:>5.2f} {r['loop_tok_s']:>10.1f} {r['loop_fraction_of_roofline']:>5.2f} "
            f"{r.get('transformers_tok_s', float('nan')):>9.1f} {r.get('transformers_fraction_of_roofline', float('nan')):>5.2f}")
    for r in rows:
        if "graphs_tok_s" in r:
            log(f"batch {r['batch']}: fused in CUDA graphs {r['graphs_tok_s']:.1f} tok/s, "
                f"{r['graphs_fraction_of_roofline']:.2f} of the roofline")
        elif "graphs_error" in r:
            log(f"batch {r['batch']}: CUDA graph capture failed: {r['graphs_error']}")
    log(f"\n{'batch':>5} {'hit':>4} {'layer fused us':>14} {'loop us':>9} {'roofline us':>11} {'frac':>5} {'speedup':>7}")
    for r in layers:
        log(f"{r['batch']:>5} {r['experts_hit']:>4} {r['fused_us']:>14.1f} {r['loop_us']:>9.1f} {r['roofline_us']:>11.1f} "
            f"{r['fused_fraction_of_roofline']:>5.2f} {r['fused_speedup_over_loop']:>7.2f}")
    by_b = {r["batch"]: r for r in rows}
    lay_b = {r["batch"]: r for r in layers}
    targets = {}
    big = max(batches)

    def target(name, measured, want):
        targets[name] = {"measured": measured, "target": want, "met": bool(measured is not None and measured >= want)}

    target(f"moe_layer_b{big}_fraction_of_roofline", lay_b[big]["fused_fraction_of_roofline"], 0.5)
    target(f"moe_layer_b{big}_speedup_over_loop", lay_b[big]["fused_speedup_over_loop"], 2.0)
    target(f"decode_b{big}_speedup_over_loop", by_b[big]["fused_tok_s"] / by_b[big]["loop_tok_s"], 1.5)
    if hf is not None:
        target(f"decode_b{big}_speedup_over_transformers",
               by_b[big]["fused_tok_s"] / by_b[big]["transformers_tok_s"], 2.0)
    if "graphs_tok_s" in by_b[min(batches)]:
        target(f"decode_b{min(batches)}_graphs_fraction_of_roofline",
               by_b[min(batches)]["graphs_fraction_of_roofline"], 0.5)
    target("fused_and_loop_decode_the_same_tokens", float(all(r["fused_equals_loop_tokens"] for r in rows)), 1.0)
    log("")
    for k, v in targets.items():
        log(f"target {k}: measured {v['measured']:.3f}, target {v['target']}, met {v['met']}")
    write_result(a, {**result_head(a, "moe", cfg, dtype), "bandwidth_gbs": bw, "decode": rows, "moe_layer": layers,
                     "targets": targets,
                     "note": None if a.gpu else "CPU: fused_moe runs its reference (the loop); flow check only"}, machine)


def result_head(a, bench: str, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """What every result of this bench names first: the bench, the day, the commit, the device, the model."""
    return {"bench": bench, "date": date.today().isoformat(), "git_commit": git_commit(("kernels", "dataplane", "bench")),
            "device": torch.cuda.get_device_name() if a.gpu else platform.processor() or "cpu",
            "model": cfg.name, "dtype": str(dtype)[6:]}


def write_result(a, res: dict, machine: str) -> None:
    """``res`` as JSON at ``--out`` (a .json path, or a directory; default bench/results/)."""
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    path = out if out.endswith(".json") else os.path.join(out, f"{res['bench']}-{res['date']}-{machine}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2, default=str)
    log(f"wrote {path}")


def offload_main(a, model, cfg, dtype, device, P, steps, timer, gen, machine) -> None:
    from moe_offload import offload_section  # noqa: PLC0415 (bench/moe_offload.py)

    batches = [int(x) for x in a.offload_batches.split(",")]
    rows, targets = offload_section(model, cfg, dtype, batches, P, steps, timer, gen)
    write_result(a, {**result_head(a, "moe-offload", cfg, dtype), "offload": rows, "targets": targets,
                     "note": None if a.gpu else
                     "CPU: copies are synchronous and the expert math is the reference loop; flow check only"}, machine)


if __name__ == "__main__":
    main()
