"""What penalties and logit_bias add to one sampling step: ``sample`` over a batch of fresh random
logits with no penalties, with every row penalized, and with half the rows penalized.

    python bench/sampler_penalties.py [--batch 64] [--vocab 49152] [--prompt 1024] [--generated 256]
                                      [--device cpu|cuda] [--repeat 20]

Prints one JSON object (milliseconds per step, best of --repeat); nothing is written.
"""
from __future__ import annotations

import argparse
import json
import random
import time

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
    out = {"commit": git_commit(("dataplane/model",)), "device": a.device, **{k: getattr(a, k) for k in
           ("batch", "vocab", "prompt", "generated", "repeat")}}
    for name, params in (("none", plain), ("all", penalized), ("half", half)):
        sample(logits, params, gens, histories)            # warm-up
        out[f"ms_{name}"] = best_ms(lambda: sample(logits, params, gens, histories), a.repeat, a.device)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
