"""Tensor-parallel groups for tests: N real processes over gloo, each running one rank of a model.

A rank writes what it saw to ``out_dir/rank{r}.json``; ``run_group`` spawns the ranks, waits for
all of them (a rank's exception fails the test with its traceback) and returns their records.
Rank entry points live here, not in a test module, so a spawned child imports nothing of pytest.
"""
from __future__ import annotations

import json
import os

import torch


def run_group(fn, size: int, args: tuple, out_dir: str) -> list[dict]:
    import sys

    import torch.multiprocessing as mp

    init = "file://" + os.path.join(out_dir, "rendezvous")
    # NOTE: pytest imports test modules by path (--import-mode=importlib); a spawned child unpickles
    # ``fn`` by its module name, so ``tests`` must be importable from the sys.path it inherits.
    where = tests_importable(out_dir)
    sys.path.insert(0, where)
    try:
        mp.spawn(fn, args=(size, init, out_dir) + args, nprocs=size, join=True)
    finally:
        sys.path.remove(where)
    recs = []
    for r in range(size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            recs.append(json.load(f))
    return recs


def tests_importable(scratch: str) -> str:
    """A directory holding only a link named ``tests`` to this checkout's tests: on sys.path it
    makes ``tests.*`` importable without putting the checkout's top-level folders there (they
    would shadow PyPI packages named events, kernels, control)."""
    where = os.path.join(scratch, "importable")
    os.makedirs(where, exist_ok=True)
    link = os.path.join(where, "tests")
    if not os.path.exists(link):
        os.symlink(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), link)
    return where


def _join(rank: int, size: int, init: str):
    from residency.dataplane.model import init_group

    torch.set_num_threads(1)
    return init_group(rank, size, init, "gloo", timeout_s=120)


def _write(out_dir: str, rank: int, rec: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


def greedy_rank(rank: int, size: int, init: str, out_dir: str, path: str | None, prompts: list[list[int]],
                max_tokens: int, page_tokens: int) -> None:
    """Load ``path`` (None: the embedded SmolLM2) as one rank and generate greedily through the
    paged pool (LocalEngine: batched prefills, then decodes)."""
    from residency.dataplane.model import SamplingParams, generate, load_model
    from residency.dataplane.model.tp import close_group

    tp = _join(rank, size, init)
    try:
        model = load_model(path, tp=tp)
        outs = generate(model, prompts, SamplingParams(max_tokens=max_tokens), page_tokens=page_tokens)
        r = model.runner
        _write(out_dir, rank, {
            "tokens": [o.token_ids for o in outs],
            "pool_shape": list(r.kv_pool_shape(1, page_tokens)),
            "block_bytes": r.allocate_kv_pool(1, page_tokens).nbytes,
            "weights_bytes": r.w.num_bytes(),
            "kv_digest": model.kv_digest,
        })
    finally:
        close_group()


def logits_rank(rank: int, size: int, init: str, out_dir: str, path: str, steps: list[list[tuple]],
                page_tokens: int, num_blocks: int) -> None:
    """Run ``steps`` (each a list of (token_ids, start_pos, block_table)) through one pool as one
    rank of the model saved at ``path``; record every step's logits and the pool's bytes."""
    from residency.dataplane.model import SeqInput, load_model
    from residency.dataplane.model.tp import close_group

    tp = _join(rank, size, init)
    try:
        model = load_model(path, tp=tp)
        pool = model.runner.allocate_kv_pool(num_blocks, page_tokens).fill_(float("nan"))
        logits = []
        for step in steps:
            batch = [SeqInput(list(t), s, list(bt)) for t, s, bt in step]
            logits.append(model.runner.forward(batch, pool).tolist())
        _write(out_dir, rank, {"logits": logits, "pool_shape": list(pool.shape),
                               "wqkv_rows": model.runner.w.layers[0].wqkv.shape[0],
                               "embed_rows": model.runner.w.embed.shape[0]})
    finally:
        close_group()
