"""The decode that bench/moe.py and bench/moe_offload.py time: a batch's KV pages, its prefill, and
``steps`` greedy steps between two device syncs. Each engine differs only in its step (the runner
eager, the runner over offloaded experts, CUDA graphs) and in what it does after a step (the
offload drains its expert moves), so those are the arguments.
"""
from __future__ import annotations

import time

from residency.dataplane.model import SeqInput

from serve_common import PAGE  # noqa: E402  (bench/serve_common.py)

PREFILL_TOKENS = 4096                 # prompt tokens per prefill forward (a few sequences at a time)


def kv_pages(runner, b: int, P: int, steps: int):
    """KV pages for ``b`` sequences of ``P`` prompt tokens and ``steps + 1`` more, in order from
    page 1 (page 0 is left over): (pages per sequence, the pool, each sequence's block table)."""
    per_seq = -(-(P + steps + 1) // PAGE)
    pool = runner.allocate_kv_pool(b * per_seq + 1, PAGE)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(b)]
    return per_seq, pool, tables


def prefill(runner, prompts: list[list[int]], tables: list[list[int]], pool) -> list[list[int]]:
    """Prefill every prompt: each sequence's first greedy token, as the list its decode grows."""
    b, P = len(prompts), len(prompts[0])
    chunk = max(1, PREFILL_TOKENS // P)
    last = []
    for i in range(0, b, chunk):
        lg = runner.forward([SeqInput(prompts[j], 0, tables[j]) for j in range(i, min(b, i + chunk))], pool)
        last.extend(lg.argmax(-1).tolist())
    return [[t] for t in last]


def runner_step(runner, pool, tables: list[list[int]], P: int):
    """The runner's eager decode step of the whole batch: ``(s, out)`` -> logits of step ``s``."""
    return lambda s, out: runner.forward([SeqInput([o[-1]], P + s, tables[j]) for j, o in enumerate(out)], pool)


def timed_decode(step, out: list[list[int]], steps: int, timer, after=None) -> float:
    """``steps`` greedy steps: ``step(s, out)`` gives the batch's logits, each sequence in ``out``
    grows by its argmax, then ``after(s)`` runs (inside the timing). Seconds between the syncs."""
    timer.sync()
    t0 = time.perf_counter()
    for s in range(steps):
        for j, t in enumerate(step(s, out).argmax(-1).tolist()):
            out[j].append(t)
        if after is not None:
            after(s)
    timer.sync()
    return time.perf_counter() - t0


__all__ = ["PREFILL_TOKENS", "kv_pages", "prefill", "runner_step", "timed_decode"]
