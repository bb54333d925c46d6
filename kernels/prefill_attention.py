"""Paged attention of a prefill that continues a cached prefix ("extend"), in one Triton launch.

A new turn of a conversation whose history is already in the pool (computed earlier, or just
restored from host memory) prefills M new tokens at positions start .. start+M-1; each attends
to every key at a position ≤ its own, i.e. the whole history plus the new tokens before it.

    queries: M tokens × num_heads        keys: ctx = start + M tokens in pages of the block table

Why not SDPA: a flash-style kernel parallelises over (heads × query tiles) only. With M = 128
new tokens and an 8k history that is a few dozen programs each walking 8k keys, while K/V
must first be gathered out of the pages and (for GQA) repeated per query head: for the 8B shape
that gather and the few programs dominate a restored turn's time to first token.

How this kernel goes faster, for the same result:
  * GQA folded into rows: a program owns one KV head and BLOCK_R rows, row r being
    (token r // GROUP, query head r % GROUP of that KV head), so a K/V page is read once for
    all GROUP query heads and any GROUP (3 for SmolLM2) works with power-of-two tiles;
  * split over keys (as flash-decoding): the key range is cut into SPLIT_TOKENS pieces, one
    program each, so ``row tiles × kv heads × splits`` programs fill the GPU even for M = 1;
  * pages read in place through the block table: no gather, no repeat, no temporary K/V;
  * a second kernel combines the splits of each row in split order (no atomics), so results
    are bitwise repeatable; a row at position p reads only splits 0 .. p // SPLIT_TOKENS.
Causality: key n is visible to a row at position p iff n ≤ p; a program stops at the last
position of its tile's latest token, and a split past every row of its tile does nothing.
"""
from __future__ import annotations

import math

import torch

from residency.kernels._common import SUM_COMBINE, KernelInputError, dual_mode_kernel, next_pow2, tl, use_triton
from residency.kernels.attention import _LOG2E, MAX_COMBINE, _check_index, _check_pool

SPLIT_TOKENS = 512   # keys per program; fixed, so a row's result never depends on M or the batch
BLOCK_R = 64         # (token, head) rows per program
BLOCK_N = 64         # keys per inner iteration (may span several pages)


def _extend_kernel(
    q_ptr, pool_ptr, bt_ptr, pm_ptr, pl_ptr, pacc_ptr,
    start_pos, num_rows, scale_log2,
    stride_qt, stride_qh, stride_pb, stride_pkv, stride_pt, stride_ph,
    stride_pmt, stride_pmh, stride_pat, stride_pah, stride_pas,
    PAGE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
):
    rt = tl.program_id(0)                 # which tile of rows
    kvh = tl.program_id(1)                # which KV head
    sp = tl.program_id(2)                 # which split of the keys
    r0 = rt * BLOCK_R
    last_row = tl.minimum(r0 + BLOCK_R, num_rows) - 1
    pos_max = start_pos + last_row // GROUP          # the latest position any row of the tile has
    lo = sp * SPLIT
    if lo <= pos_max:                                # else no row of the tile needs this split
        hi = tl.minimum(lo + SPLIT, pos_max + 1)
        r = r0 + tl.arange(0, BLOCK_R)
        rm = r < num_rows
        tok = r // GROUP
        head = kvh * GROUP + r % GROUP
        pos = start_pos + tok
        d = tl.arange(0, D_PAD)
        dm = d < HEAD_DIM
        qm = rm[:, None] & dm[None, :]
        q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=qm, other=0.0)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_R], 0.0, tl.float32)
        acc = tl.full([BLOCK_R, D_PAD], 0.0, tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < hi
            slot = tl.load(bt_ptr + n // PAGE, mask=nm, other=0).to(tl.int64)
            base = slot * stride_pb + (n % PAGE).to(tl.int64) * stride_pt + kvh * stride_ph
            kvm = nm[:, None] & dm[None, :]
            k = tl.load(pool_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0)
            v = tl.load(pool_ptr + stride_pkv + base[:, None] + d[None, :], mask=kvm, other=0.0)
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = nm[None, :] & (n[None, :] <= pos[:, None])
            s = tl.where(visible, s * scale_log2, float("-inf"))
            # A row whose position precedes this split sees no key here: its m stays -inf and
            # its partial is never read (the combine stops at split pos // SPLIT); keep it NaN-free.
            m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        pm = tok.to(tl.int64) * stride_pmt + head * stride_pmh + sp
        tl.store(pm_ptr + pm, m_i, mask=rm)
        tl.store(pl_ptr + pm, l_i, mask=rm)
        pa = tok[:, None].to(tl.int64) * stride_pat + head[:, None] * stride_pah + sp * stride_pas + d[None, :]
        tl.store(pacc_ptr + pa, acc, mask=qm)


def _extend_combine_kernel(
    out_ptr, pm_ptr, pl_ptr, pacc_ptr, start_pos,
    stride_ot, stride_oh, stride_pmt, stride_pmh, stride_pat, stride_pah, stride_pas,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = (start_pos + t) // SPLIT + 1        # the splits holding keys 0 .. start_pos + t
    d = tl.arange(0, D_PAD)
    dm = d < HEAD_DIM
    pm = pm_ptr + t.to(tl.int64) * stride_pmt + h * stride_pmh
    pl = pl_ptr + t.to(tl.int64) * stride_pmt + h * stride_pmh
    pa = pacc_ptr + t.to(tl.int64) * stride_pat + h * stride_pah
    m = tl.load(pm)
    l_sum = tl.load(pl)
    acc = tl.load(pa + d, mask=dm, other=0.0)
    for s in range(1, num_splits):                   # split order: fixed, no atomics
        ms = tl.load(pm + s)
        m_new = tl.maximum(m, ms)
        a_old = tl.exp2(m - m_new)
        a_new = tl.exp2(ms - m_new)
        l_sum = l_sum * a_old + tl.load(pl + s) * a_new
        acc = acc * a_old + tl.load(pa + s * stride_pas + d, mask=dm, other=0.0) * a_new
        m = m_new
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             (acc / l_sum).to(out_ptr.dtype.element_ty), mask=dm)


_extend = dual_mode_kernel(_extend_kernel)
_extend_combine = dual_mode_kernel(_extend_combine_kernel)


def paged_extend_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor, start_pos: int,
    sm_scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [M, num_heads, head_dim] (RoPE applied, tokens at positions
    start_pos .. start_pos+M-1, their K/V already written to the pool) over the sequence's pages.

    ``block_table`` [≥ ceil((start_pos+M)/page)] ints on the pool's device. Returns ``out``
    [M, num_heads, head_dim] in q's dtype. Query head h reads KV head h // (num_heads // num_kv).
    Refuses by name: wrong ranks, dtypes or devices, non-unit inner strides, head counts that do
    not divide, head_dim > 256, a negative start, a block table too short for the context.
    """
    op = "paged_extend_attention"
    _check_pool(op, kv_pool, layer)
    dev = kv_pool.device
    num_kv, page, hd = kv_pool.shape[4], kv_pool.shape[3], kv_pool.shape[5]
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != hd:
        raise KernelInputError(f"{op}: q must be [M, num_heads, {hd}], got "
                               f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype != kv_pool.dtype or q.device != dev:
        raise KernelInputError(f"{op}: q is {q.dtype} on {q.device}; kv_pool is {kv_pool.dtype} on {dev}")
    if q.stride(2) != 1:
        raise KernelInputError(f"{op}: q must have unit stride along head_dim, got strides {q.stride()}")
    M, nh, _ = q.shape
    if nh % num_kv:
        raise KernelInputError(f"{op}: num_heads {nh} is not a multiple of num_kv_heads {num_kv}")
    if hd > 256:
        raise KernelInputError(f"{op}: head_dim {hd} > 256 is not supported")
    _check_index(op, "block_table", block_table, 1, dev)
    start_pos = int(start_pos)
    if start_pos < 0:
        raise KernelInputError(f"{op}: start_pos must be >= 0, got {start_pos}")
    ctx = start_pos + M
    if block_table.shape[0] * page < ctx:
        raise KernelInputError(f"{op}: block table of {block_table.shape[0]} pages holds "
                               f"{block_table.shape[0] * page} tokens; the context is {ctx}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(hd)
    if out is None:
        out = torch.empty(M, nh, hd, dtype=q.dtype, device=dev)
    elif out.shape != (M, nh, hd) or out.stride(2) != 1 or out.dtype != q.dtype:
        raise KernelInputError(f"{op}: out must be [{M}, {nh}, {hd}] {q.dtype} with unit last stride")
    if M == 0:
        return out
    if not use_triton(dev):
        return paged_extend_attention_ref(q, kv_pool, layer, block_table, start_pos, scale, out)
    group = nh // num_kv
    splits = -(-ctx // SPLIT_TOKENS)
    pm = torch.empty(M, nh, splits, dtype=torch.float32, device=dev)
    pls = torch.empty(M, nh, splits, dtype=torch.float32, device=dev)
    pacc = torch.empty(M, nh, splits, hd, dtype=torch.float32, device=dev)
    pl = kv_pool[:, layer]
    d_pad = max(16, next_pow2(hd))
    _extend[(-(-M * group // BLOCK_R), num_kv, splits)](
        q, pl, block_table, pm, pls, pacc,
        start_pos, M * group, scale * _LOG2E,
        q.stride(0), q.stride(1), pl.stride(0), pl.stride(1), pl.stride(2), pl.stride(3),
        pm.stride(0), pm.stride(1), pacc.stride(0), pacc.stride(1), pacc.stride(2),
        PAGE=page, GROUP=group, HEAD_DIM=hd, D_PAD=d_pad, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
        SPLIT=SPLIT_TOKENS,
        # float32 pools, and the interpreter (whose tl.dot mis-reads bfloat16), dot in float32.
        FP32_DOT=q.dtype == torch.float32 or dev.type != "cuda",
    )
    _extend_combine[(M, nh)](
        out, pm, pls, pacc, start_pos,
        out.stride(0), out.stride(1), pm.stride(0), pm.stride(1),
        pacc.stride(0), pacc.stride(1), pacc.stride(2),
        HEAD_DIM=hd, D_PAD=d_pad, SPLIT=SPLIT_TOKENS,
    )
    return out


def paged_extend_attention_ref(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor, start_pos: int,
    sm_scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: gather the context's pages, causal mask by position, softmax in
    float32. Positions past the context may hold anything (even NaN); they are never read."""
    M, nh, hd = q.shape
    page, num_kv = kv_pool.shape[3], kv_pool.shape[4]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(hd)
    ctx = start_pos + M
    nb = -(-ctx // page)
    kv = kv_pool[block_table[:nb].long(), layer].float()                  # [nb, 2, page, kv, hd]
    k = kv[:, 0].reshape(nb * page, num_kv, hd)[:ctx]
    v = kv[:, 1].reshape(nb * page, num_kv, hd)[:ctx]
    qf = q.float().view(M, num_kv, nh // num_kv, hd)
    s = torch.einsum("mngd,lnd->ngml", qf, k) * scale
    pos = start_pos + torch.arange(M, device=q.device)
    hidden = torch.arange(ctx, device=q.device)[None, :] > pos[:, None]    # [M, ctx]
    s = s.masked_fill(hidden[None, None], float("-inf"))
    o = torch.einsum("ngml,lnd->mngd", torch.softmax(s, dim=-1), v).reshape(M, nh, hd)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out


__all__ = ["paged_extend_attention", "paged_extend_attention_ref", "SPLIT_TOKENS"]
