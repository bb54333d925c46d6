"""The serving loop's decode path: a captured CUDA graph where it can serve, eager elsewhere.

The choice is one pure function, tested here on any host; on CPU every step is eager ("no CUDA")
and says so in its StepCompleted. On a GPU (in bench/gpu_session.sh's test set) the loop with
graphs gives the same greedy tokens as the loop without them, and its decode steps replay graphs.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.model.runner import SeqInput
from residency.dataplane.mover import Mover
from residency.dataplane.pools import KVLayout
from residency.dataplane.serving import ServingLoop
from residency.dataplane.serving_graphs import (
    GRAPH_MAX_TOKENS, StepGraphs, decode_path, graph_sizes_for, graph_table_width,
)
from residency.events.catalog import StepCompleted
from residency.events.commands import Generate, SamplingParams, TokensGenerated
from residency.kernels.attention import rope_and_cache, rope_and_cache_ref
from tests.serving.stack import ByteTokenizer

P = 16
SIZES = (1, 2, 4, 8)
_ids = itertools.count(5000)


def choose(**kw):
    args = dict(on_cuda=True, sizes=SIZES, new_tokens=[1, 1, 1], table_widths=[3, 5, 2], max_blocks=8,
                pool_current=True)
    args.update(kw)
    return decode_path(**args)


# ---------------------------------------------------------------- the choice (pure)
def test_a_decode_batch_is_padded_up_to_the_next_captured_size():
    got = choose()
    assert (got.path, got.batch_size) == ("graph", 4) and "padded to 4" in got.why
    assert choose(new_tokens=[1] * 8, table_widths=[1] * 8).batch_size == 8
    assert choose(new_tokens=[1], table_widths=[1]).batch_size == 1


def test_without_cuda_the_same_selection_answers_eager_no_cuda():
    got = choose(on_cuda=False)
    assert (got.path, got.why, got.batch_size) == ("eager", "no CUDA", 0)


@pytest.mark.parametrize("kw, why", [
    (dict(new_tokens=[1, 37, 1]), "prefill: 1 of 3 sequences take more than one token"),
    (dict(new_tokens=[1] * 9, table_widths=[1] * 9), "batch 9 > largest graph 8"),
    (dict(table_widths=[3, 9, 2]), "block table of 9 pages > the 8 captured"),
    (dict(pool_current=False), "the pool moved to another generation since capture"),
    (dict(sizes=()), "no graphs captured"),
    (dict(batch_invariant=True), "a batch-invariant runner has no graph"),
    (dict(layers_landing=True), "pages still landing layer by layer"),
])
def test_a_step_a_graph_cannot_serve_runs_eager_and_names_why(kw, why):
    got = choose(**kw)
    assert (got.path, got.why, got.batch_size) == ("eager", why, 0)


def test_a_graph_table_covers_the_models_window_up_to_a_cap():
    assert graph_table_width(2048, 16) == 128 and graph_table_width(2049, 16) == 129
    assert graph_table_width(131072, 16) == GRAPH_MAX_TOKENS // 16


def test_captured_sizes_cover_every_batch_up_to_max_seqs():
    assert graph_sizes_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_sizes_for(48) == (1, 2, 4, 8, 16, 32, 48)
    assert graph_sizes_for(1) == (1,)
    for max_seqs in (1, 3, 48, 64):
        sizes = graph_sizes_for(max_seqs)
        assert all(choose(sizes=sizes, new_tokens=[1] * n, table_widths=[1] * n).path == "graph"
                   for n in range(1, max_seqs + 1))


# ---------------------------------------------------------------- padding rows write nothing
@pytest.mark.parametrize("fn", [rope_and_cache, rope_and_cache_ref])
def test_a_token_with_slot_minus_one_writes_no_kv(fn):
    """The padding rows of a graph carry slot -1: the pool keeps every byte it had."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, hd, layers = 4, 2, 8, 2
    pool = torch.randn(5, layers, 2, P, kv_heads, hd, generator=g)
    before = pool.clone()
    qkv = torch.randn(3, (heads + 2 * kv_heads) * hd, generator=g)
    cos, sin = torch.randn(64, hd // 2, generator=g), torch.randn(64, hd // 2, generator=g)
    pos = torch.tensor([5, 9, 0], dtype=torch.int32)
    slots = torch.tensor([2, -1, -1], dtype=torch.int32)
    offs = torch.tensor([5, 9, 0], dtype=torch.int32)
    q = fn(qkv, cos, sin, pos, slots, offs, pool, 1, heads)
    changed = (pool != before).nonzero()[:, :4].unique(dim=0).tolist()
    assert {tuple(c[:2]) + (c[3],) for c in changed} == {(2, 1, 5)}       # slot 2, layer 1, offset 5 only
    want = rope_and_cache_ref(qkv, cos, sin, pos, torch.tensor([2, 3, 4], dtype=torch.int32), offs,
                              before.clone(), 1, heads)
    assert torch.allclose(q, want)                                       # Q rotated for every row


# ---------------------------------------------------------------- the serving loop
CFG = ModelConfig(name="tiny-graphs", num_layers=3, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate=256, vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                  max_position=512, tie_embeddings=True)


def make_loop(model, tmp_path, graphs: bool, device_blocks: int = 64):
    kv = KVLayout(CFG.num_layers, P, CFG.num_kv_heads, CFG.head_dim, dtype=model.runner.dtype)
    host = 8 * kv.block_bytes
    mover = Mover(kv, device_blocks, host, tmp_path / f"g{graphs}", Mover.pinned_bytes_needed(kv, device_blocks, host),
                  str(model.runner.device), fsync=False)
    sg = None
    if graphs:
        sg = StepGraphs.capture(model.runner, mover.device_pool.tensor, max_seqs=8,
                                max_blocks_per_seq=-(-model.runner.max_positions // P))
    loop = ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                       model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys,
                       max_seqs=8, graphs=sg)
    return mover, loop


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 257) for _ in range(n)] for n in (23, 40, 9)]


def serve_three(loop: ServingLoop, ids: list[list[int]], max_tokens: int = 12
                ) -> tuple[dict[str, list[int]], list[StepCompleted]]:
    """Three greedy requests, the third joining after three steps (decode batches of 2, then 3)."""
    out: list = []

    def gen(i: int) -> Generate:
        return Generate(request_id=f"r{i}", session=None, token_ids=ids[i],
                        block_ids=[next(_ids) for _ in range(-(-(len(ids[i]) + max_tokens) // P))],
                        num_cached_tokens=0, free_on_finish=True,
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    out += loop.handle(gen(0)) + loop.handle(gen(1))
    for _ in range(3):
        out += loop.step()
    out += loop.handle(gen(2))
    while loop.has_work():
        out += loop.step()
    toks = {f"r{i}": [t for o in out if isinstance(o, TokensGenerated) and o.request_id == f"r{i}"
                      for t in o.token_ids] for i in range(3)}
    return toks, [o for o in out if isinstance(o, StepCompleted)]


def test_on_cpu_every_step_is_eager_and_says_so(tmp_path):
    model = random_model(CFG, "cpu", torch.float32, seed=random.randrange(1 << 16))
    _, loop = make_loop(model, tmp_path, graphs=False)
    toks, steps = serve_three(loop, prompts(random.randrange(1 << 30)), max_tokens=4)
    assert all(len(t) == 4 for t in toks.values())
    assert {s.decode_path for s in steps} == {"eager"}
    assert loop.graphs.num_steps == {"graph": 0, "eager": len(steps)}
    assert loop.graphs.last.why == "no CUDA"
    ready = loop.ready(block_bytes=1)
    assert ready.decode_graph_sizes == [] and ready.decode_graph_bytes is None
    assert StepGraphs.capture(model.runner, loop.pool.tensor, max_seqs=8, max_blocks_per_seq=4).graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_with_graphs_equals_eager_output(tmp_path, dtype):
    seed = random.randrange(1 << 16)
    model = random_model(CFG, "cuda", dtype, seed=seed)
    ids = prompts(seed)
    _, eager = make_loop(model, tmp_path / "e", graphs=False)
    want, eager_steps = serve_three(eager, ids)
    _, graphed = make_loop(model, tmp_path / "g", graphs=True)
    assert graphed.graphs.sizes == (1, 2, 4, 8) and graphed.graphs.graph_bytes is not None
    got, steps = serve_three(graphed, ids)
    assert got == want, f"seed {seed}"
    assert {s.decode_path for s in eager_steps} == {"eager"}
    paths = [s.decode_path for s in steps]
    assert "graph" in paths and "eager" in paths                  # prefill steps eager, decodes graphed
    assert all(p == "graph" for s, p in zip(steps, paths) if s.num_tokens == s.num_seqs)
    assert graphed.graphs.num_steps == {"graph": paths.count("graph"), "eager": paths.count("eager")}
    ready = graphed.ready(block_bytes=1)
    assert ready.decode_graph_sizes == [1, 2, 4, 8] and ready.decode_graph_bytes == graphed.graphs.graph_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_pool_other_than_the_captured_one_is_served_eagerly(tmp_path):
    model = random_model(CFG, "cuda", torch.bfloat16, seed=1)
    mover, loop = make_loop(model, tmp_path, graphs=True)
    one = [SeqInput([7], 20, [0, 1])]
    moved = loop.graphs.choose(one, torch.empty_like(mover.device_pool.tensor))
    assert (moved.path, moved.why) == ("eager", "the pool moved to another generation since capture")
    assert loop.graphs.choose(one, mover.device_pool.tensor).path == "graph"


class _Pool:
    """The two things a reader touches on a rebind: the new tensor and the stamp."""

    def __init__(self, tensor):
        self.tensor, self.stamps = tensor, {}

    def stamp(self, reader: str, gen: int) -> None:
        self.stamps[reader] = gen


def test_without_graphs_a_rebind_stamps_with_nothing_to_capture():
    model = random_model(CFG, "cpu", torch.float32, seed=2)
    sg = StepGraphs(model.runner)
    pool = _Pool(torch.empty(4, *model.runner.kv_pool_shape(1, P)[1:]))
    sg.bind(pool, 5)
    assert pool.stamps == {"graphs": 5} and sg.gen == 5 and sg.graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_rebind_to_another_tensor_captures_the_graphs_again(tmp_path):
    model = random_model(CFG, "cuda", torch.bfloat16, seed=4)
    mover, loop = make_loop(model, tmp_path, graphs=True)
    old = mover.device_pool.tensor
    from residency.dataplane.memory_books import MemoryBooks  # noqa: PLC0415

    books = loop.graphs.books = MemoryBooks(0, "cuda", None, None, graphs_bytes=loop.graphs.graph_bytes)
    pool = _Pool(torch.empty(old.shape[0] * 2, *old.shape[1:], dtype=old.dtype, device=old.device))
    loop.graphs.bind(pool, 1)
    one = [SeqInput([7], 20, [0, 1])]
    assert pool.stamps == {"graphs": 1} and loop.graphs.sizes == (1, 2, 4, 8)
    assert books.probe(1).device_owned.get("graphs") == loop.graphs.graph_bytes is not None   # the new capture's
    assert loop.graphs.choose(one, pool.tensor).path == "graph" and loop.graphs.choose(one, old).path == "eager"
    loop.graphs.bind(pool, 2)                                  # the same tensor again: kept as captured
    assert pool.stamps == {"graphs": 2} and loop.graphs.choose(one, pool.tensor).path == "graph"


class _Captured:
    """What a capture leaves at the edge the CPU cannot reach (CUDA graphs): the pool it read and its sizes."""

    def __init__(self, pool, sizes=SIZES, max_blocks=4):
        self.pool, self.sizes, self.max_blocks = pool, sizes, max_blocks


def test_every_capture_after_start_updates_the_memory_books_and_a_drop_unknowns_them(monkeypatch):
    """The books' ``graphs`` figure follows the current capture (a pool rebind, a flip or wake) and
    leaves when none is held: never the start figure after a re-capture, never a 0 nobody measured."""
    from residency.dataplane.memory_books import MemoryBooks  # noqa: PLC0415

    model = random_model(CFG, "cpu", torch.float32, seed=5)
    shape = model.runner.kv_pool_shape(1, P)[1:]
    first = random.randrange(1 << 20, 1 << 30)
    sg = StepGraphs(model.runner, _Captured(torch.empty(4, *shape)), graph_bytes=first)
    books = MemoryBooks(0, "cpu", None, None, graphs_bytes=sg.graph_bytes)
    sg.books = books
    taken = []

    def capture(runner, kv_pool, *, max_seqs, max_blocks_per_seq):
        taken.append(random.randrange(1 << 20, 1 << 30))
        return StepGraphs(runner, _Captured(kv_pool), graph_bytes=taken[-1])

    monkeypatch.setattr(StepGraphs, "capture", staticmethod(capture))
    pool = _Pool(torch.empty(8, *shape))
    sg.bind(pool, 1)                                       # a resize: captured again over the new pool
    assert books.probe(1).device_owned["graphs"] == taken[-1] != first
    sg.use_runner(model.runner, pool.tensor, max_seqs=8, max_blocks_per_seq=4, capture=True)   # a flip or wake
    assert books.probe(2).device_owned["graphs"] == taken[-1] and len(taken) == 2
    sg.drop()                                              # a sleep: no graphs held, nothing measured
    assert "graphs" not in books.probe(3).device_owned
    sg.use_runner(model.runner, pool.tensor, max_seqs=8, max_blocks_per_seq=4, capture=True)

    def refused(*a, **kw):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(StepGraphs, "capture", staticmethod(refused))
    sg.bind(_Pool(torch.empty(16, *shape)), 2)             # a failed re-capture: eager, and not the old figure
    assert sg.graphs is None and "graphs" not in books.probe(4).device_owned
