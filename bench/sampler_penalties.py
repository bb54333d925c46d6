"""What penalties and logit_bias add to one sampling step: ``sample`` over a batch of fresh random
logits with no penalties, with every row penalized, and with half the rows penalized.

    python bench/sampler_penalties.py [--batch 64] [--vocab 49152] [--prompt 1024] [--generated 256]
                                      [--device cpu|cuda] [--repeat 20] [--out PATH]

Prints a table and writes JSON (milliseconds per step, best of --repeat) to --out, by default
bench/results/sampler-penalties-<date>-<machine>.json. The target: a step with every row penalized
costs at most 4x a plain step. It is there to catch a return to per-token work: the first version,
a Python loop over each row's tokens, cost about 13x on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from datetime import date

import torch

from residency.dataplane.model.sampler import SamplingParams, sample

from commit import git_commit  # noqa: E402  (bench/commit.py)


def best_ms(fn, repeat: int, device: str) -> float:
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()                                   # sample() returns host ints: the step has finished
        times.append((time.perf_counter() - t) * 1e3)
    return round(min(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--generated", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", help="where the JSON goes (default: bench/results/sampler-penalties-<date>-<machine>.json)")
    a = ap.parse_args()
    rng = random.Random()
    logits = torch.randn(a.batch, a.vocab, device=a.device)
    histories = [([rng.randrange(a.vocab) for _ in range(a.prompt + a.generated)], a.prompt)
                 for _ in range(a.batch)]
    plain = [SamplingParams()] * a.batch
    penalized = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1,
                                logit_bias={rng.randrange(a.vocab): 5.0 for _ in range(8)}) for _ in range(a.batch)]
    half = penalized[:a.batch // 2] + plain[a.batch // 2:]
    gens = [None] * a.batch
    machine = "cpu" if a.device == "cpu" else next(
        (k for k in ("h200", "h100", "a100") if k in torch.cuda.get_device_name().lower()), "gpu")
    out = {"bench": "sampler-penalties", "date": date.today().isoformat(), "machine": machine,
           "git_commit": git_commit(("dataplane/model",)), "device": a.device,
           **{k: getattr(a, k) for k in ("batch", "vocab", "prompt", "generated", "repeat")}}
    for name, params in (("none", plain), ("all", penalized), ("half", half)):
        sample(logits, params, gens, histories)            # warm-up
        out[f"ms_{name}"] = best_ms(lambda: sample(logits, params, gens, histories), a.repeat, a.device)
    ratio = round(out["ms_all"] / out["ms_none"], 2) if out["ms_none"] > 0 else None
    out["targets"] = {"all_rows_penalized_over_plain": {"measured": ratio, "target": 4.0,
                                                         "met": ratio is not None and ratio <= 4.0}}
    print(f"sampling step, batch {a.batch}, vocab {a.vocab}, history {a.prompt}+{a.generated}, {a.device}")
    for name in ("none", "half", "all"):
        print(f"  penalized rows: {name:>4}  {out[f'ms_{name}']:9.3f} ms")
    t = out["targets"]["all_rows_penalized_over_plain"]
    print(f"target all/none <= {t['target']}: {t['measured']} {'met' if t['met'] else 'MISSED'}")
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                 f"sampler-penalties-{out['date']}-{machine}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
