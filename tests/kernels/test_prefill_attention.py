"""The extend (prefill-over-a-cached-prefix) attention kernel against its torch reference, and the
reference against the runner's SDPA path and a float64 row-by-row attention.

Irregular shapes: GQA ratios 1/3/4, M = 1 and M not a multiple of any tile, histories that cross
split boundaries, pages of 5 and 16 tokens, shuffled block tables. Pools are NaN outside the
context and outputs are poisoned first, so a stray read or an unwritten element fails loudly.
"""
from __future__ import annotations

import math

import pytest
import torch

from residency.kernels._common import KernelInputError
from residency.kernels.prefill_attention import SPLIT_TOKENS, paged_extend_attention, paged_extend_attention_ref


def make_case(gen, device, *, start, M, nh, nkv, hd, page, layers=2, dtype=torch.float32):
    ctx = start + M
    nb = -(-ctx // page)
    num_blocks = nb + 7
    pool = torch.full((num_blocks, layers, 2, page, nkv, hd), float("nan"), dtype=dtype)
    table = torch.randperm(num_blocks, generator=gen)[: nb + 1].to(torch.int32)   # one spare entry
    for p in range(ctx):
        pool[table[p // page], :, :, p % page] = torch.randn(layers, 2, nkv, hd, generator=gen).to(dtype)
    q = torch.randn(M, nh, hd, generator=gen).to(dtype)
    return q.to(device), pool.to(device), table.to(device)


CASES = [
    # start,              M,  heads, kv, hd, page
    (0,                   9,   4,  4, 16, 16),      # a fresh prefill, MHA
    (37,                  1,   9,  3, 64, 16),      # one new token (a decode), SmolLM2's 3:1
    (SPLIT_TOKENS - 5,   23,   9,  3, 32,  5),      # the new tokens straddle a split boundary
    (SPLIT_TOKENS + 130, 30,   8,  2, 32, 16),      # two splits of history, ratio 4, 60 rows
    (70,                 40,   8,  2, 24, 12),      # head_dim 24 (padded), more rows than a tile
]


@pytest.mark.parametrize("start, M, nh, nkv, hd, page", CASES)
def test_extend_kernel_matches_reference(gen, device, start, M, nh, nkv, hd, page):
    q, pool, table = make_case(gen, device, start=start, M=M, nh=nh, nkv=nkv, hd=hd, page=page)
    out = torch.full_like(q, float("nan"))
    got = paged_extend_attention(q, pool, 1, table, start, out=out)
    want = paged_extend_attention_ref(q, pool, 1, table, start)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "an output element was not written"
    assert (got - want).abs().max() < 1e-5


def test_reference_matches_float64_rows_and_runner_sdpa(gen):
    from residency.dataplane.model.attention import paged_prefill_attention

    start, M, nh, nkv, hd, page = 45, 7, 6, 2, 16, 8
    q, pool, table = make_case(gen, "cpu", start=start, M=M, nh=nh, nkv=nkv, hd=hd, page=page, dtype=torch.float64)
    scale = 1 / math.sqrt(hd)
    got = paged_extend_attention_ref(q, pool, 0, table, start, scale)
    for m in range(M):                                         # one query row at a time, by definition
        pos = start + m
        keys = torch.stack([pool[table[p // page], 0, 0, p % page] for p in range(pos + 1)])   # [pos+1, kv, hd]
        vals = torch.stack([pool[table[p // page], 0, 1, p % page] for p in range(pos + 1)])
        for h in range(nh):
            kvh = h // (nh // nkv)
            w = torch.softmax(keys[:, kvh] @ q[m, h] * scale, dim=0)
            assert torch.allclose(got[m, h].double(), w @ vals[:, kvh], atol=1e-6)
    sdpa = paged_prefill_attention(q.float(), pool.float(), 0, table.long(), start, start + M, scale)
    assert (sdpa.double() - got.double()).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_kernel_half_precision_within_rounding(gen, device, dtype):
    q, pool, table = make_case(gen, device, start=SPLIT_TOKENS + 3, M=17, nh=8, nkv=2, hd=32, page=16, dtype=dtype)
    got = paged_extend_attention(q, pool, 0, table, SPLIT_TOKENS + 3).float()
    want = paged_extend_attention_ref(q.float(), pool.float(), 0, table, SPLIT_TOKENS + 3)
    assert (got - want).norm() / want.norm() < 1e-2


def test_extend_kernel_is_bitwise_repeatable(gen, device):
    q, pool, table = make_case(gen, device, start=SPLIT_TOKENS + 9, M=11, nh=4, nkv=2, hd=16, page=16)
    a = paged_extend_attention(q, pool, 0, table, SPLIT_TOKENS + 9)
    b = paged_extend_attention(q, pool, 0, table, SPLIT_TOKENS + 9)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, pool, t: (q[:, :3], pool, t, 3), "not a multiple"),
    (lambda q, pool, t: (q.to(torch.float64), pool, t, 3), "float64"),
    (lambda q, pool, t: (q, pool, t[:1], 3), "block table of 1 pages"),
    (lambda q, pool, t: (q, pool, t, -1), "start_pos must be >= 0"),
    (lambda q, pool, t: (q, pool, t.float(), 3), "block_table must be an int32/int64 tensor"),
    (lambda q, pool, t: (q, pool[..., :8], t, 3), "q must be [M, num_heads, 8]"),
])
def test_extend_kernel_refuses_by_name(gen, mutate, message):
    q, pool, table = make_case(gen, "cpu", start=3, M=4, nh=4, nkv=2, hd=16, page=4)
    q2, pool2, t2, start = mutate(q, pool, table)
    with pytest.raises(KernelInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        paged_extend_attention(q2, pool2, 0, t2, start)
