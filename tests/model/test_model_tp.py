"""Tensor parallelism of the runner in real processes over gloo: SmolLM2 at TP=3 against TP=1,
a random model at TP=2 loaded from safetensors, and the refusals with their arithmetic."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import (
    SMOLLM2_135M,
    SamplingParams,
    SeqInput,
    TensorParallel,
    TensorParallelRefused,
    generate,
    load_model,
    random_model,
    refuse_tp,
)
from residency.dataplane.model.config import OLMOE_1B_7B
from tests.model.helpers_model import write_hf_dir
from tests.model.helpers_tp import greedy_rank, logits_rank, run_group

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


def test_smollm2_at_tp3_gives_the_greedy_tokens_of_tp1(smollm2, tmp_path):
    # 9 query and 3 KV heads, intermediate 1536, vocab 49152: all divide by 3
    ids = [smollm2.tokenizer.encode(p, add_special=True) for p in PROMPTS]
    page = 8                                        # prompts of 5, 7, 10 tokens + 6 new cross pages
    want = [o.token_ids for o in generate(smollm2, ids, SamplingParams(max_tokens=6), page_tokens=page)]
    recs = run_group(greedy_rank, 3, (None, ids, 6, page), str(tmp_path))
    for r, rec in enumerate(recs):
        assert rec["tokens"] == want, f"rank {r}"
    full_pool = smollm2.runner.allocate_kv_pool(1, page)
    assert recs[0]["pool_shape"] == [1, 30, 2, page, 1, 64]          # one KV head per rank
    assert all(rec["block_bytes"] * 3 == full_pool.nbytes for rec in recs)
    # a rank holds its third of every matrix, the embedding included (norms are replicated)
    assert all(rec["weights_bytes"] < smollm2.weights.num_bytes() / 3 * 1.01 for rec in recs)
    assert len({rec["kv_digest"] for rec in recs}) == 1 and recs[0]["kv_digest"] != smollm2.kv_digest


TINY = SMOLLM2_135M.replace(
    name="tiny-tp", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=96,
    vocab_size=301, max_position=512, tie_embeddings=False, attention_bias=True,   # odd vocab: the last rank pads
)


def test_a_random_model_at_tp2_from_safetensors_matches_tp1_prefill_and_decode(tmp_path, rng):
    seed = rng.randrange(1 << 30)
    whole = random_model(TINY, seed=seed)
    write_hf_dir(str(tmp_path / "model"), whole)
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, TINY.vocab_size, (21,), generator=g).tolist()
    b = torch.randint(0, TINY.vocab_size, (6,), generator=g).tolist()
    steps = [
        [(a[:13], 0, [3, 0]), (b, 0, [5])],                       # two prefills (13 tokens over 2 pages)
        [(a[13:], 13, [3, 0, 1]), (b[-1:] + [7], 6, [5])],         # an extend over cached pages and a 2-token step
        [([a[-1]], 21, [3, 0, 1]), ([9], 8, [5, 2])],              # decodes, the second onto a new page
    ]
    one = load_model(str(tmp_path / "model"))
    pool = one.runner.allocate_kv_pool(6, 8).fill_(float("nan"))
    want = [one.runner.forward([SeqInput(t, s, bt) for t, s, bt in step], pool) for step in steps]
    recs = run_group(logits_rank, 2, (str(tmp_path / "model"), steps, 8, 6), str(tmp_path))
    for r, rec in enumerate(recs):
        assert rec["pool_shape"] == [6, 2, 2, 8, 1, 16]
        assert rec["wqkv_rows"] == (2 + 2 * 1) * 16 and rec["embed_rows"] == 151
        for i, (got, exp) in enumerate(zip(rec["logits"], want)):
            got = torch.tensor(got)
            assert got.shape == exp.shape
            assert torch.isfinite(got).all(), f"rank {r} step {i} read an unwritten page"
            torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5, msg=f"rank {r} step {i}")
    assert recs[0]["logits"] == recs[1]["logits"]      # every rank holds the same bits after the gather


def test_a_split_that_does_not_divide_is_refused_with_its_arithmetic():
    r = refuse_tp(SMOLLM2_135M, 2)
    assert r is not None and r.remainders == (("num_heads", 9, 2, 1), ("num_kv_heads", 3, 2, 1))
    assert "num_heads 9 % 2 = 1" in r.reason and "num_kv_heads 3 % 2 = 1" in r.reason
    assert refuse_tp(SMOLLM2_135M, 3) is None and refuse_tp(SMOLLM2_135M, 1) is None
    assert refuse_tp(TINY.replace(intermediate=97), 2).remainders == (("intermediate", 97, 2, 1),)
    assert "mixture-of-experts" in refuse_tp(OLMOE_1B_7B, 2).reason
    with pytest.raises(TensorParallelRefused, match=r"num_kv_heads 3 % 2 = 1") as e:
        load_model(None, tp=TensorParallel(0, 2))           # refused before any weight is read or peer joined
    assert e.value.refused.size == 2


def test_a_row_slice_of_a_gguf_tensor_dequantizes_to_the_rows_of_the_whole(rng):
    from residency.dataplane.model.gguf_file import GGUFFile
    from residency.dataplane.model.loader import embedded_model_path

    f = GGUFFile(embedded_model_path())
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        whole, lazy = f.load(name), f.lazy(name)
        lo = rng.randrange(whole.shape[0] - 1)
        hi = rng.randrange(lo + 1, whole.shape[0] + 1)
        assert lazy.get_shape() == tuple(whole.shape)
        assert torch.equal(lazy[lo:hi], whole[lo:hi]), (name, lo, hi)
        assert torch.equal(lazy[:, lo % whole.shape[1]:], whole[:, lo % whole.shape[1]:]), name


def test_the_shards_of_every_rank_put_together_are_the_whole_model(rng):
    from residency.dataplane.model.tp import shard_weights
    from residency.dataplane.model.weights import random_weights

    size = 3
    config = TINY.replace(num_heads=6, num_kv_heads=3, intermediate=99, tie_embeddings=True)   # vocab 301 = 3·101 - 2
    whole = random_weights(config, seed=rng.randrange(1 << 30))
    parts = [shard_weights(whole, config, TensorParallel(r, size)) for r in range(size)]
    assert all(p.lm_head is p.embed for p in parts)                    # a tied model keeps one shard for both
    embed = torch.cat([p.embed for p in parts])
    assert embed.shape[0] == 303 and torch.equal(embed[:301], whole.embed) and not embed[301:].any()
    nq, nkv, i = 6 * 16, 3 * 16, 99
    for layer, lw in enumerate(whole.layers):
        ls = [p.layers[layer] for p in parts]
        q, k, v = lw.wqkv.split([nq, nkv, nkv])
        assert torch.equal(torch.cat([x.wqkv[:nq // size] for x in ls]), q)
        assert torch.equal(torch.cat([x.wqkv[nq // size:(nq + nkv) // size] for x in ls]), k)
        assert torch.equal(torch.cat([x.wqkv[(nq + nkv) // size:] for x in ls]), v)
        assert torch.equal(torch.cat([x.bqkv for x in ls]).sort().values, lw.bqkv.sort().values)
        assert torch.equal(torch.cat([x.wo for x in ls], dim=1), lw.wo)
        gate, up = lw.w_gate_up.split([i, i])
        assert torch.equal(torch.cat([x.w_gate_up[:i // size] for x in ls]), gate)
        assert torch.equal(torch.cat([x.w_gate_up[i // size:] for x in ls]), up)
        assert torch.equal(torch.cat([x.w_down for x in ls], dim=1), lw.w_down)
    # a rank's rows own their storage: a view would keep the whole matrix alive in every rank
    assert all(p.embed.untyped_storage().nbytes() == p.embed.nbytes for p in parts)
