"""Triton paged-attention kernels against their torch references (interpreted on CPU hosts),
and the references against a float64 one-row-at-a-time attention.

Irregular shapes throughout: odd context lengths, contexts of one token and of several decode
splits, GQA ratios 1/3/4/8, page sizes that are not powers of two, block tables whose length is
not a power of two, slots scattered and shuffled. Pools are NaN outside the written context and
outputs are poisoned first, so an unwritten output or a stray read fails loudly.
"""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model.attention import lower_right_mask, paged_attention_invariant, paged_prefill_attention
from residency.kernels._common import KernelInputError
from residency.kernels.attention import (
    SPLIT_TOKENS,
    paged_decode_attention,
    paged_decode_attention_ref,
    rope_and_cache,
    rope_and_cache_ref,
)
from tests.model.helpers_model import naive_attention

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def _interpret_triton_on_cpu(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_case(gen, *, contexts, num_heads, num_kv, head_dim, page, num_blocks, layers=2, dtype=torch.float32):
    """A NaN pool with random K/V written only at the positions each sequence's context covers."""
    B = len(contexts)
    width = max(-(-c // page) for c in contexts) + 1            # one spare entry past every context
    pool = torch.full((num_blocks, layers, 2, page, num_kv, head_dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: B * width].view(B, width).to(torch.int32)
    for b, c in enumerate(contexts):
        for p in range(c):
            pool[tables[b, p // page], :, :, p % page] = torch.randn(layers, 2, num_kv, head_dim, generator=gen).to(dtype)
    q = torch.randn(B, num_heads, head_dim, generator=gen).to(dtype)
    return q.to(DEVICE), pool.to(DEVICE), tables.to(DEVICE), torch.tensor(contexts, dtype=torch.int32, device=DEVICE)


CASES = [
    # contexts,                         heads, kv, hd, page, blocks
    ([1, 7, 33],                           4,  4, 16,  16, 12),     # MHA, tiny contexts
    ([17, 130, 5],                         9,  3, 64,  16, 40),     # SmolLM2's GQA 3:1
    ([SPLIT_TOKENS + 3, 2 * SPLIT_TOKENS + 129, 1], 8, 2, 32, 16, 150),   # several splits, ratio 4
    ([301, 45],                            8,  1, 16,   5, 140),    # page of 5 tokens, ratio 8
    ([3 * SPLIT_TOKENS - 1],               6,  2, 24,  12, 80),     # head_dim 24 (padded), page 12
]


@pytest.mark.parametrize("contexts, nh, nkv, hd, page, nblocks", CASES)
def test_triton_decode_matches_reference(gen, contexts, nh, nkv, hd, page, nblocks):
    q, pool, tables, ctx = make_case(gen, contexts=contexts, num_heads=nh, num_kv=nkv, head_dim=hd,
                                     page=page, num_blocks=nblocks)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(q, pool, 1, tables, ctx, out=out)
    want = paged_decode_attention_ref(q, pool, 1, tables, ctx)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was not written"
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_half_precision_within_rounding(gen, dtype):
    q, pool, tables, ctx = make_case(gen, contexts=[SPLIT_TOKENS + 77, 19], num_heads=8, num_kv=2, head_dim=32,
                                     page=16, num_blocks=60, dtype=dtype)
    got = paged_decode_attention(q, pool, 0, tables, ctx).float()
    want = paged_decode_attention_ref(q.float(), pool.float(), 0, tables, ctx)
    assert (got - want).norm() / want.norm() < 1e-2


def test_triton_decode_is_bitwise_repeatable_and_batch_invariant(gen):
    """The same sequence alone or beside others, in any order: the same bits."""
    q, pool, tables, ctx = make_case(gen, contexts=[2 * SPLIT_TOKENS + 5, 40, 300], num_heads=8, num_kv=2,
                                     head_dim=32, page=16, num_blocks=110)
    full = paged_decode_attention(q, pool, 1, tables, ctx)
    again = paged_decode_attention(q, pool, 1, tables, ctx)
    alone = paged_decode_attention(q[:1], pool, 1, tables[:1], ctx[:1])
    swapped = paged_decode_attention(q[[2, 0]], pool, 1, tables[[2, 0]], ctx[[2, 0]])
    assert torch.equal(full, again)
    assert torch.equal(full[0], alone[0]) and torch.equal(full[0], swapped[1])


@pytest.mark.parametrize("contexts, nh, nkv, hd, page, nblocks", CASES[:4])
def test_decode_reference_matches_float64_attention(gen, contexts, nh, nkv, hd, page, nblocks):
    q, pool, tables, ctx = make_case(gen, contexts=contexts, num_heads=nh, num_kv=nkv, head_dim=hd,
                                     page=page, num_blocks=nblocks)
    got = paged_decode_attention_ref(q.cpu(), pool.cpu(), 1, tables.cpu(), ctx.cpu())
    for b, c in enumerate(contexts):
        k = torch.stack([pool[tables[b, p // page], 1, 0, p % page].cpu() for p in range(c)])
        v = torch.stack([pool[tables[b, p // page], 1, 1, p % page].cpu() for p in range(c)])
        want = naive_attention(q[b:b + 1].cpu(), k, v, torch.tensor([c - 1]))[0]
        assert (got[b].double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("attend", [paged_prefill_attention, paged_attention_invariant])
@pytest.mark.parametrize("start, new, page", [(0, 37, 16), (45, 30, 16), (300, 1, 7), (0, 290, 12)])
def test_prefill_paths_match_float64_attention(gen, attend, start, new, page):
    nh, nkv, hd = 6, 2, 16
    ctx = start + new
    _, pool, tables, _ = make_case(gen, contexts=[ctx], num_heads=nh, num_kv=nkv, head_dim=hd, page=page,
                                   num_blocks=-(-ctx // page) + 5)
    pool, table = pool.cpu(), tables[0].cpu()
    q = torch.randn(new, nh, hd, generator=gen)
    got = attend(q, pool, 0, table, start, ctx, hd ** -0.5)
    k = torch.stack([pool[table[p // page], 0, 0, p % page] for p in range(ctx)])
    v = torch.stack([pool[table[p // page], 0, 1, p % page] for p in range(ctx)])
    want = naive_attention(q, k, v, torch.arange(start, ctx))
    assert (got.double() - want).abs().max() < 2e-5


def test_the_cpu_lower_right_mask_is_the_one_torchs_causal_bias_builds(gen):
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F
    for m, ctx in ((1, 1), (3, 17), (12, 332), (40, 41)):
        assert torch.equal(lower_right_mask(m, ctx, "cpu"), causal_lower_right(m, ctx)._materialize(torch.device("cpu")))
        q, k, v = (torch.randn(1, 6, n, 16, generator=gen) for n in (m, ctx, ctx))
        k, v = k[:, :2], v[:, :2]
        ours = F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right_mask(m, ctx, "cpu"), enable_gqa=True)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(m, ctx), enable_gqa=True)
        assert torch.equal(ours, theirs), (m, ctx)


def test_a_cpu_prefill_over_cached_pages_does_not_import_torch_dynamo():
    """A first reused prefix once paid this import (seconds on a busy host) mid-request."""
    import subprocess
    import sys
    code = (
        "import sys, torch\n"
        "from residency.dataplane.model.attention import paged_prefill_attention\n"
        "pool = torch.randn(4, 1, 2, 8, 2, 16)\n"
        "paged_prefill_attention(torch.randn(5, 6, 16), pool, 0, torch.tensor([2, 0, 3]), 15, 20, 0.25)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_rope_and_cache_kernel_matches_reference(gen):
    nh, nkv, hd, page, T = 6, 2, 64, 10, 23
    from residency.dataplane.model.config import SMOLLM2_135M, rope_inv_freq, rope_tables

    cos, sin = rope_tables(rope_inv_freq(SMOLLM2_135M), 500)
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=gen)
    pos = torch.randint(0, 500, (T,), generator=gen, dtype=torch.int32)
    flat = torch.randperm(8 * page, generator=gen)[:T]               # distinct (slot, offset) targets
    slots, offs = (flat // page).to(torch.int32), (flat % page).to(torch.int32)
    pool = torch.full((8, 3, 2, page, nkv, hd), float("nan"))
    p_ref = pool.clone()
    args = [t.to(DEVICE) for t in (qkv, cos, sin, pos, slots, offs)]
    p_dev = pool.to(DEVICE)
    q_out = torch.full((T, nh, hd), float("nan"), device=DEVICE)
    q = rope_and_cache(*args, p_dev, 2, nh, q_out=q_out)
    q_ref = rope_and_cache_ref(qkv, cos, sin, pos, slots, offs, p_ref, 2, nh)
    assert (q.cpu() - q_ref).abs().max() < 1e-6
    written = ~p_ref.isnan()
    assert torch.equal(written, ~p_dev.cpu().isnan()), "the kernel wrote other positions than the reference"
    assert int(written.sum()) == T * 2 * nkv * hd
    assert (p_dev.cpu()[written] - p_ref[written]).abs().max() < 1e-6
    # V is stored as is; K rotated: position 0 leaves it unchanged
    assert torch.equal(p_ref[slots[0], 2, 1, offs[0]], qkv[0, (nh + nkv) * hd:].view(nkv, hd))


@pytest.mark.parametrize("mutate, match", [
    (lambda q, p, t, c: (q.double(), p, t, c), "dtype"),
    (lambda q, p, t, c: (q, p, t.float(), c), "int32/int64"),
    (lambda q, p, t, c: (q[:, :3], p, t, c), "not a multiple"),
    (lambda q, p, t, c: (q, p.transpose(4, 5), t, c), "unit stride"),
    (lambda q, p, t, c: (q, p[:, :, :1], t, c), "dim 2 must be 2"),
    (lambda q, p, t, c: (q, p, t[:1], c), "block tables"),
])
def test_decode_wrapper_refuses_unsupported_inputs_by_name(gen, mutate, match):
    q, pool, tables, ctx = make_case(gen, contexts=[5, 9], num_heads=4, num_kv=2, head_dim=16, page=4, num_blocks=8)
    with pytest.raises(KernelInputError, match=match):
        q, pool, tables, ctx = mutate(q, pool, tables, ctx)
        paged_decode_attention(q, pool, 0, tables, ctx)


def test_decode_refuses_a_context_longer_than_its_block_table(gen):
    q, pool, tables, ctx = make_case(gen, contexts=[5, 9], num_heads=4, num_kv=2, head_dim=16, page=4, num_blocks=8)
    if CUDA:
        pytest.skip("bounds are checked on the host only (a device check would sync every step)")
    with pytest.raises(KernelInputError, match="context_lens"):
        paged_decode_attention(q, pool, 0, tables, ctx * 10)
