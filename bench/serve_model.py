#!/usr/bin/env python3
"""Model-runner bench: decode and prefill speed, TTFT with a restored history, numerics checks.

    python bench/serve_model.py --cpu            # embedded SmolLM2 GGUF on this host's CPU
    python bench/serve_model.py --gpu --out DIR  # random bf16 weights, SmolLM2 and Llama-3-8B shapes
    python bench/serve_model.py --gpu --dry-run  # the GPU flow with tiny shapes on the CPU (no graphs)

GPU figures are fractions of the memory roofline: a decode step must read every weight once
(the LM head, not the embedding table) and every sequence's K/V once, so
    roofline_time = (weight_bytes + Σ context · kv_bytes_per_token) / bandwidth
with the bandwidth measured in the same run (a device-to-device copy, read + write counted).
Each figure is measured side by side with transformers' ``generate`` on the same weights.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date

import numpy as np
import torch


from residency.dataplane.model import LLAMA3_8B, SMOLLM2_135M, SamplingParams, SeqInput, load_model, random_model  # noqa: E402
from residency.dataplane.model.hf_reference import build_hf_llama  # noqa: E402

from serve_common import PAGE, Timer, d2d_bandwidth, log, rel, slot_tables  # noqa: E402,F401
from serve_ttft import bench_ttft  # noqa: E402

from commit import git_commit  # noqa: E402  (bench/commit.py)

DATE = date.today().isoformat()
GIT_COMMIT = git_commit()


# ------------------------------------------------------------------ numerics on the device
def check_kernels(device: torch.device) -> dict:
    from residency.kernels.attention import paged_decode_attention, paged_decode_attention_ref, rope_and_cache, rope_and_cache_ref

    out = {}
    g = torch.Generator().manual_seed(0)
    for name, nh, nkv, hd, ctxs in (("smollm2", 9, 3, 64, [1, 77, 600]), ("llama3_8b", 32, 8, 128, [5, 300, 1100, 4097])):
        for dtype in (torch.bfloat16, torch.float32):
            nb = sum(-(-c // PAGE) for c in ctxs) + 8
            pool = torch.randn(nb, 2, 2, PAGE, nkv, hd, generator=g).to(dtype).to(device)
            w = max(-(-c // PAGE) for c in ctxs)
            tables = torch.tensor([t + [0] * (w - len(t)) for t in slot_tables(len(ctxs), w, 0, g)], dtype=torch.int32)
            tables = tables.clamp(max=nb - 1).to(device)
            ctx = torch.tensor(ctxs, dtype=torch.int32, device=device)
            q = torch.randn(len(ctxs), nh, hd, generator=g).to(dtype).to(device)
            o = torch.full_like(q, float("nan"))
            paged_decode_attention(q, pool, 1, tables, ctx, out=o)
            ref = paged_decode_attention_ref(q.float(), pool.float(), 1, tables, ctx)
            again = paged_decode_attention(q, pool, 1, tables, ctx)
            out[f"decode_{name}_{str(dtype)[6:]}"] = {
                "rel_err_vs_ref_fp32": rel(o.float(), ref), "nan": bool(o.isnan().any()),
                "bitwise_repeatable": bool(torch.equal(o, again))}
        T = 37
        qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g).to(device)
        from residency.dataplane.model.config import rope_inv_freq, rope_tables
        cos, sin = (x.to(device) for x in rope_tables(rope_inv_freq(LLAMA3_8B.replace(head_dim=hd)), 5000))
        pos = torch.randint(0, 5000, (T,), generator=g, dtype=torch.int32).to(device)
        slots = torch.arange(T, dtype=torch.int32, device=device) // PAGE
        offs = torch.arange(T, dtype=torch.int32, device=device) % PAGE
        p1 = torch.zeros(4, 2, 2, PAGE, nkv, hd, device=device)
        p2 = p1.clone()
        q1 = rope_and_cache(qkv, cos, sin, pos, slots, offs, p1, 1, nh)
        q2 = rope_and_cache_ref(qkv, cos, sin, pos, slots, offs, p2, 1, nh)
        out[f"rope_cache_{name}"] = {"q_max_abs_err": float((q1 - q2).abs().max()),
                                     "pool_max_abs_err": float((p1 - p2).abs().max())}
    return out


def check_runner_vs_hf(model, hf, device: torch.device, graphs=None, prompt_len: int = 100) -> dict:
    """Prefill + 4 decode steps (eager, and through the graphs when given) vs transformers."""
    g = torch.Generator().manual_seed(1)
    cfg, r = model.config, model.runner
    ids = torch.randint(0, cfg.vocab_size, (prompt_len + 4,), generator=g).tolist()
    nb = -(-len(ids) // PAGE)
    pool = r.allocate_kv_pool(nb + 1, PAGE).fill_(float("nan"))
    table = list(range(nb))[::-1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device=device)).logits[0].float()
    got = [r.forward([SeqInput(ids[:prompt_len], 0, table)], pool)[0]]
    for i in range(4):
        got.append(r.forward([SeqInput([ids[prompt_len + i]], prompt_len + i, table)], pool)[0])
    got = torch.stack(got[:4])
    want = ref[prompt_len - 1: prompt_len + 3]
    res = {"dtype": str(r.dtype)[6:], "rel_err_logits": rel(got, want),
           "greedy_agree": int((got.argmax(-1) == want.argmax(-1)).sum()), "of": 4}
    if graphs is not None:
        gpool = graphs.pool
        gpool[: nb].fill_(float("nan"))
        gt = np.array([table])
        r.forward([SeqInput(ids[:prompt_len], 0, table)], gpool)
        outs = []
        for i in range(3):
            outs.append(graphs.step(np.array([ids[prompt_len + i]]), np.array([prompt_len + i]), gt)[0].clone())
        res["graph_rel_err_logits"] = rel(torch.stack(outs), ref[prompt_len: prompt_len + 3])
        res["graph_equals_eager_bitwise"] = bool(torch.equal(torch.stack(outs), got[1:4]))
    return res


# ------------------------------------------------------------------ decode speed
def bench_decode(model, hf, device, batch_sizes, prompt_len, steps, bw_gbs, graphs_cls, gen) -> list[dict]:
    cfg, r = model.config, model.runner
    timer = Timer(device)
    bmax = max(batch_sizes)
    per_seq = -(-(prompt_len + steps + 8) // PAGE)
    pool = r.allocate_kv_pool(bmax * per_seq + 1, PAGE)
    scratch = bmax * per_seq
    graphs = None
    if graphs_cls is not None:
        t0 = time.perf_counter()
        graphs = graphs_cls(r, pool, max_blocks_per_seq=per_seq, scratch_slot=scratch,
                            batch_sizes=tuple(sorted(set(batch_sizes))))
        log(f"  captured graphs for {sorted(set(batch_sizes))} in {time.perf_counter() - t0:.1f}s")
    weight_bytes = cfg.weight_bytes_read_per_step(r.dtype)
    kv_tok = cfg.kv_bytes_per_token(r.dtype)
    rows = []
    for B in batch_sizes:
        tables = slot_tables(B, per_seq, 0, gen)
        prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=gen)
        t_prefill = timer(lambda: r.forward([SeqInput(prompts[b].tolist(), 0, tables[b]) for b in range(B)], pool),
                          repeat=1, warmup=0)
        first = r.forward([SeqInput(prompts[b].tolist(), 0, tables[b]) for b in range(B)], pool).argmax(-1).tolist()

        def eager(n=steps):
            toks = list(first)
            for s in range(n):
                toks = r.forward([SeqInput([toks[b]], prompt_len + s, tables[b]) for b in range(B)],
                                 pool).argmax(-1).tolist()

        eager(2)                                             # warm-up (kernels compiled, allocator primed)
        t_eager = timer(eager, repeat=1, warmup=0)
        row = {"model": cfg.name, "batch": B, "prompt_len": prompt_len, "steps": steps,
               "prefill_tok_s": B * prompt_len / t_prefill}
        ctx_mean = prompt_len + steps / 2
        step_bytes = weight_bytes + B * ctx_mean * kv_tok
        roof = step_bytes / (bw_gbs * 1e9)
        row.update(step_bytes=step_bytes, roofline_step_ms=roof * 1e3,
                   ours_eager_step_ms=t_eager / steps * 1e3, ours_eager_tok_s=B * steps / t_eager,
                   ours_eager_roofline=roof / (t_eager / steps))
        if graphs is not None:
            bt_np = np.array(tables, dtype=np.int32)

            def graphed(n=steps):
                toks = np.array(first)
                for s in range(n):
                    toks = graphs.step(toks, np.full(B, prompt_len + s), bt_np).argmax(-1).cpu().numpy()

            timer(lambda: graphed(4), repeat=1)
            t_graph = timer(graphed, repeat=1, warmup=0)
            # device time alone: replays back to back, no host round trip between steps
            toks = np.array(first)
            graphs.step(toks, np.full(B, prompt_len), bt_np)
            gph, _ = graphs.graphs[next(s for s in graphs.sizes if s >= B)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                gph.replay()
            end.record()
            torch.cuda.synchronize()
            t_dev = start.elapsed_time(end) / 1e3 / steps
            row.update(ours_graph_step_ms=t_graph / steps * 1e3, ours_graph_tok_s=B * steps / t_graph,
                       ours_graph_roofline=roof / (t_graph / steps),
                       graph_replay_step_ms=t_dev * 1e3, graph_replay_roofline=roof / t_dev)
        if hf is not None:
            row.update(hf_decode(hf, prompts, device, steps, roof))
        best = max(row.get("ours_graph_tok_s", 0), row["ours_eager_tok_s"])
        if "hf_tok_s" in row:
            row["speedup_vs_hf"] = best / row["hf_tok_s"]
        rows.append(row)
        log("  " + fmt_row(row))
    del pool, graphs
    return rows


def hf_decode(hf, prompts, device, steps, roof) -> dict:
    """transformers' generate: step time from two lengths, so its prefill cancels out."""
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    timer = Timer(device)
    n1, n2 = 4, 4 + steps

    def run(n):
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)

    t1 = timer(lambda: run(n1), repeat=3, warmup=1)
    t2 = timer(lambda: run(n2), repeat=2, warmup=0)
    step = max(t2 - t1, 1e-9) / (n2 - n1)
    return {"hf_step_ms": step * 1e3, "hf_tok_s": ids.shape[0] / step, "hf_roofline": roof / step}


def fmt_row(r: dict) -> str:
    s = f"{r['model']:>14} B={r['batch']:>3}  eager {r['ours_eager_tok_s']:9.1f} tok/s ({r['ours_eager_roofline']:5.1%})"
    if "ours_graph_tok_s" in r:
        s += f"  graph {r['ours_graph_tok_s']:9.1f} tok/s ({r['ours_graph_roofline']:5.1%}; replay {r['graph_replay_roofline']:5.1%})"
    if "hf_tok_s" in r:
        s += f"  HF {r['hf_tok_s']:8.1f} tok/s ({r['hf_roofline']:5.1%})  x{r['speedup_vs_hf']:.1f}"
    return s


# ------------------------------------------------------------------ TTFT with a restored history
def stage(res: dict, key: str, save, fn):
    """Run one part of the bench; a failure is recorded (with its traceback) and the rest goes on."""
    import traceback

    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a bench run must report every part it can
        res.setdefault("errors", {})[key] = traceback.format_exc()
        log(f"!! {key} failed: {e!r}")
        return None
    finally:
        save(res)


def run_gpu(args, save) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    res: dict = {"date": DATE, "git_commit": GIT_COMMIT,
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                 "torch": torch.__version__, "dtype": str(dtype)[6:]}
    try:
        import triton
        import transformers
        res.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    bw = d2d_bandwidth(device) if not args.dry_run else 20.0
    res["d2d_bandwidth_gbs"] = bw
    log(f"device {res['device']}  d2d copy bandwidth {bw:.0f} GB/s (read+write)")
    res["kernel_checks"] = stage(res, "kernel_checks", save, lambda: check_kernels(device))
    log("kernel checks: " + json.dumps(res["kernel_checks"]))
    graphs_cls = None
    if device.type == "cuda":
        from residency.dataplane.model.graphs import DecodeGraphs
        graphs_cls = DecodeGraphs
    configs = [SMOLLM2_135M, LLAMA3_8B]                       # small and launch-bound; large and HBM-bound
    if args.dry_run:
        configs = [SMOLLM2_135M.replace(num_layers=2, hidden=96, num_heads=3, num_kv_heads=1, head_dim=32,
                                        intermediate=128, vocab_size=512),
                   LLAMA3_8B.replace(num_layers=2, hidden=256, num_heads=8, num_kv_heads=2, head_dim=32,
                                     intermediate=512, vocab_size=1024)]
    res["decode"], res["numerics"] = [], {}
    if args.ttft_only:                                       # a short call: only the 8B-shape TTFT
        configs = configs[-1:]
    for cfg in configs:
        log(f"== {cfg.name}")
        if args.ttft_only:
            model = random_model(cfg, device, dtype, seed=3, max_positions=args.history + 1024)
            res["ttft"] = stage(res, "ttft", save, lambda: bench_ttft(model, device, args.history, args.new_turn, gen))
            break
        if cfg is configs[0]:                                # fp32 numerics: a tight check
            def fp32_check():
                m32 = random_model(cfg, device, torch.float32, seed=3, max_positions=4096)
                return check_runner_vs_hf(m32, build_hf_llama(cfg, m32.weights), device)
            res["numerics"][cfg.name + "_fp32"] = stage(res, f"numerics_{cfg.name}_fp32", save, fp32_check)
            log("  fp32 numerics vs transformers: " + json.dumps(res["numerics"][cfg.name + "_fp32"]))
        model = random_model(cfg, device, dtype, seed=3, max_positions=args.history + 1024)
        hf = build_hf_llama(cfg, model.weights)

        def numerics():
            small_graphs = None
            if graphs_cls is not None:
                npool = model.runner.allocate_kv_pool(-(-110 // PAGE) + 2, PAGE)
                small_graphs = graphs_cls(model.runner, npool, max_blocks_per_seq=-(-110 // PAGE),
                                          scratch_slot=npool.shape[0] - 1, batch_sizes=(1,))
            return check_runner_vs_hf(model, hf, device, small_graphs)

        res["numerics"][cfg.name] = stage(res, f"numerics_{cfg.name}", save, numerics)
        log("  numerics vs transformers: " + json.dumps(res["numerics"][cfg.name]))
        rows = stage(res, f"decode_{cfg.name}", save, lambda: bench_decode(
            model, hf, device, args.batch_sizes, args.prompt_len, args.steps, bw, graphs_cls, gen))
        res["decode"] += rows or []
        if cfg is configs[-1]:
            res["ttft"] = stage(res, "ttft", save, lambda: bench_ttft(model, device, args.history, args.new_turn, gen))
        del model, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def run_cpu(args) -> dict:
    res: dict = {"date": DATE, "git_commit": GIT_COMMIT, "device": "cpu", "cpu": platform.processor() or platform.machine(),
                 "cores": os.cpu_count(), "torch": torch.__version__, "dtype": "float32",
                 "load_average_at_start": os.getloadavg()}
    m = load_model(None)
    res["model"] = "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, dequantized to fp32)"
    tok, r = m.tokenizer, m.runner
    text = tok.apply_chat_template([{"role": "user", "content": "Write a short paragraph about the sea. " * 40}])
    prompt = tok.encode(text)[:256]
    res["rows"] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for invariant in (False, True):
            r.batch_invariant = invariant
            pool = r.allocate_kv_pool(80, PAGE)
            timer = Timer(torch.device("cpu"))
            t_pre = timer(lambda: r.forward([SeqInput(prompt, 0, list(range(20)))], pool), repeat=3)
            steps = 24

            def dec(B):
                tables = [list(range(20 * b, 20 * b + 20)) for b in range(B)]
                for b in range(1, B):
                    r.forward([SeqInput(prompt, 0, tables[b])], pool)
                toks = [5] * B
                t = time.perf_counter()
                for s in range(steps):
                    toks = r.forward([SeqInput([toks[b]], len(prompt) + s, tables[b]) for b in range(B)],
                                     pool).argmax(-1).tolist()
                return B * steps / (time.perf_counter() - t)

            row = {"threads": threads, "batch_invariant": invariant, "prompt_tokens": len(prompt),
                   "prefill_tok_s": len(prompt) / t_pre, "decode_b1_tok_s": dec(1), "decode_b4_tok_s": dec(4),
                   "load_average": os.getloadavg()[0]}
            res["rows"].append(row)
            log(f"threads={threads} invariant={invariant}: prefill {row['prefill_tok_s']:.0f} tok/s, decode b1 "
                f"{row['decode_b1_tok_s']:.1f} tok/s, b4 {row['decode_b4_tok_s']:.1f} tok/s (load {row['load_average']:.1f})")
    r.batch_invariant = False
    torch.set_num_threads(args.threads[0])
    from residency.dataplane.model import chat
    t = time.perf_counter()
    reply = chat(m, [{"role": "user", "content": "Give me three tips for a good night's sleep."}],
                 SamplingParams(max_tokens=80))
    res["chat_example"] = {"reply": reply, "wall_s": time.perf_counter() - t}
    log(f"chat reply in {res['chat_example']['wall_s']:.1f}s: {reply!r}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="embedded SmolLM2 on the CPU")
    ap.add_argument("--gpu", action="store_true", help="random bf16 weights on the GPU (SmolLM2 and 8B shapes)")
    ap.add_argument("--dry-run", action="store_true", help="with --gpu: tiny shapes on the CPU, no graphs")
    ap.add_argument("--out", default=None, help="directory (or .json file) for the results")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--history", type=int, default=8192)
    ap.add_argument("--ttft-only", action="store_true", help="with --gpu: only the multi-turn TTFT on the 8B shape")
    ap.add_argument("--new-turn", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if args.cpu:
        default = os.path.join(results, f"serve-model-{DATE}-cpu.json")
    else:
        default = os.path.join(results, f"serve-{DATE}-{'dryrun' if args.dry_run else 'h200'}.json")
    out = args.out or default
    if os.path.isdir(out):
        out = os.path.join(out, os.path.basename(default))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def save(res: dict) -> None:                               # after every stage: a cut-off run keeps its figures
        with open(out, "w") as f:
            json.dump(res, f, indent=2, default=str)

    res = run_cpu(args) if args.cpu else run_gpu(args, save)
    save(res)
    log(f"wrote {out}")
    if res.get("decode"):
        log("\n" + table(res))


def table(res: dict) -> str:
    lines = [f"{'model':>14} {'B':>3} {'roof ms':>8} {'eager ms':>9} {'eager%':>7} {'graph ms':>9} {'graph%':>7} "
             f"{'replay%':>8} {'HF ms':>8} {'HF%':>6} {'vs HF':>6}"]
    for r in res["decode"]:
        lines.append(f"{r['model']:>14} {r['batch']:>3} {r['roofline_step_ms']:8.2f} {r['ours_eager_step_ms']:9.2f} "
                     f"{r['ours_eager_roofline']:7.1%} {r.get('ours_graph_step_ms', float('nan')):9.2f} "
                     f"{r.get('ours_graph_roofline', float('nan')):7.1%} {r.get('graph_replay_roofline', float('nan')):8.1%} "
                     f"{r.get('hf_step_ms', float('nan')):8.2f} {r.get('hf_roofline', float('nan')):6.1%} "
                     f"{r.get('speedup_vs_hf', float('nan')):6.1f}")
    if "ttft" in res:
        t = res["ttft"]
        lines.append(f"TTFT {t['history_tokens']}+{t['new_tokens']}: restore+prefill {t['ttft_restore_ms']:.1f} ms, "
                     f"recompute {t['ttft_recompute_ms']:.1f} ms, x{t['speedup']:.1f} "
                     f"(same greedy token: {t['same_greedy_token']})"
                     + (f"; layer-pipelined restore {t['ttft_pipelined_ms']:.1f} ms, x{t['speedup_pipelined']:.1f}"
                        if "ttft_pipelined_ms" in t else ""))
        lines.append(f"TTFT {t['history_tokens']}+{t['new_tokens']}, the history another session's prefix: read in place "
                     f"{t['ttft_shared_in_place_ms']:.1f} ms, x{t['speedup_shared_in_place']:.1f}; copied on the device "
                     f"{t['ttft_shared_copied_ms']:.1f} ms (copy {t['shared_copy_ms']:.2f} ms), "
                     f"x{t['speedup_shared_copied']:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
