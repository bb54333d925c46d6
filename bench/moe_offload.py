"""`bench/moe.py --offload`: decode with the experts offloaded to pinned host memory.

For each device budget (100%, 50%, 25% of the expert bytes) the same prompts decode greedily
through a runner whose experts visit S device slots a layer (dataplane/model/experts.py), beside
the all-resident runner of the same run. Per budget and batch:

    tok/s                 decode steps only (prefill and the start-up placement excluded)
    served_from_device    of the expert bytes the decode steps routed to, the share already in a
                          slot (resident or prefetched) when its layer ran; the rest were fetched
    copy GB/s             bytes over the measured time of the copies (fetches and prefetches)
    tokens_equal          greedy tokens identical to the all-resident runner's (they must be)

Each step's moves are drained as the serving worker drains them (one ExpertsMoved a step), so the
measured time includes reading the copies' CUDA events.
"""
from __future__ import annotations

import time

import torch

from residency.dataplane.model.expert_policy import parse_expert_budget
from residency.dataplane.model.experts import offload_model

from moe_decode import kv_pages, prefill, runner_step, timed_decode  # noqa: E402  (bench/moe_decode.py)
from serve_common import log  # noqa: E402  (bench/serve_common.py)

BUDGETS = ("100%", "50%", "25%")


def decode(model, prompts: list[list[int]], steps: int, timer, offload=None) -> tuple[float, list[list[int]], dict]:
    """Prefill, then ``steps`` greedy decode steps of the whole batch: (seconds of the decode
    steps, tokens per sequence, what the offload moved and served during them)."""
    runner = model.runner
    P = len(prompts[0])
    _, pool, tables = kv_pages(runner, len(prompts), P, steps)
    out = prefill(runner, prompts, tables, pool)
    moved = {"fetch": 0, "prefetch": 0, "evict": 0, "copied_bytes": 0, "copy_ns": 0}
    if offload is not None:
        offload.drain(0, 0)
        before = offload.served_totals()

    def drain(s):
        if offload is None:
            return
        for e in offload.drain(0, s + 1):
            for m in e.moves:
                moved[m.kind] += 1
                if m.kind != "evict":
                    moved["copied_bytes"] += m.bytes
                    moved["copy_ns"] += m.ns or 0

    seconds = timed_decode(runner_step(runner, pool, tables, P), out, steps, timer, after=drain)
    if offload is not None:
        after = offload.served_totals()
        dev, fetched = after[0] - before[0], after[1] - before[1]
        moved["served_device_bytes"], moved["served_fetched_bytes"] = dev, fetched
        moved["served_from_device"] = dev / (dev + fetched) if dev + fetched else None
    return seconds, out, moved


def offload_section(model, cfg, dtype, batches: list[int], P: int, steps: int, timer, gen) -> tuple[list[dict], dict]:
    rows = []
    expert_total = cfg.num_layers * cfg.num_experts * cfg.expert_bytes(dtype)
    for b in batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, P), generator=gen).tolist()
        decode(model, prompts, 2, timer)                                   # warm-up (Triton compile)
        t_res, toks_res, _ = decode(model, prompts, steps, timer)
        base = {"batch": b, "prompt_tokens": P, "steps": steps, "resident_tok_s": b * steps / t_res}
        log(f"batch {b}: all-resident {base['resident_tok_s']:.1f} tok/s")
        for budget in BUDGETS:
            t_setup = time.perf_counter()
            om, off = offload_model(model, parse_expert_budget(budget))
            setup_s = time.perf_counter() - t_setup
            try:
                decode(om, prompts, 2, timer, off)                         # warm-up: kernels, the first frequencies
                t, toks, moved = decode(om, prompts, steps, timer, off)
            finally:
                off.close()
            row = {**base, "budget": budget, "slots_per_layer": off.S,
                   "device_expert_bytes": off.slot_bytes, "expert_bytes_total": expert_total,
                   "tok_s": b * steps / t, "fraction_of_resident_tok_s": (b * steps / t) / base["resident_tok_s"],
                   "served_from_device": moved.pop("served_from_device"), "moves": moved,
                   "copied_bytes_per_step": moved["copied_bytes"] / steps,
                   "copy_gbs": moved["copied_bytes"] / moved["copy_ns"] if moved["copy_ns"] else None,
                   "tokens_equal_resident": toks == toks_res, "setup_s": setup_s}
            rows.append(row)
            sfd = row["served_from_device"]
            log(f"  budget {budget:>4} ({off.S} slots/layer): {row['tok_s']:.1f} tok/s "
                f"({row['fraction_of_resident_tok_s']:.2f} of resident), served from device "
                f"{'-' if sfd is None else f'{sfd:.2f}'}, copied {row['copied_bytes_per_step'] / 2**20:.1f} MiB/step, "
                f"tokens equal {row['tokens_equal_resident']}")
            del om, off
            if timer.cuda:
                torch.cuda.empty_cache()
    log("")
    log(f"{'batch':>5} {'budget':>6} {'slots':>5} {'tok/s':>9} {'resident':>9} {'frac':>5} {'served dev':>10} "
        f"{'MiB/step':>9} {'copy GB/s':>9} {'equal':>5}")
    for r in rows:
        sfd, gbs = r["served_from_device"], r["copy_gbs"]
        log(f"{r['batch']:>5} {r['budget']:>6} {r['slots_per_layer']:>5} {r['tok_s']:>9.1f} {r['resident_tok_s']:>9.1f} "
            f"{r['fraction_of_resident_tok_s']:>5.2f} {'-' if sfd is None else f'{sfd:.3f}':>10} "
            f"{r['copied_bytes_per_step'] / 2**20:>9.1f} {'-' if gbs is None else f'{gbs:.1f}':>9} "
            f"{str(r['tokens_equal_resident']):>5}")
    targets = {}

    def target(name, measured, want):
        targets[name] = {"measured": measured, "target": want, "met": bool(measured is not None and measured >= want)}

    target("offloaded_tokens_equal_resident", float(all(r["tokens_equal_resident"] for r in rows)), 1.0)
    full = [r for r in rows if r["budget"] == "100%"]
    target("budget_100_served_from_device", min(r["served_from_device"] or 0 for r in full), 1.0)
    target("budget_100_fraction_of_resident_tok_s", min(r["fraction_of_resident_tok_s"] for r in full), 0.8)
    b1 = [r for r in rows if r["batch"] == min(batches) and r["budget"] == "50%"]
    if b1:
        target(f"budget_50_b{min(batches)}_fraction_of_resident_tok_s", b1[0]["fraction_of_resident_tok_s"], 0.25)
    for k, v in targets.items():
        log(f"target {k}: measured {v['measured']:.3f}, target {v['target']}, met {v['met']}")
    return rows, targets


__all__ = ["BUDGETS", "decode", "offload_section"]
