"""Paged attention over the block-first device KV pool: cache write with RoPE, and decode.

The pool is ONE tensor per model, block-first:

    kv_pool [num_blocks, num_layers, 2, page_tokens, num_kv_heads, head_dim]
                 │            │     └ 0 = K, 1 = V
                 │            └ layer l of every block is kv_pool[:, l]
                 └ a "slot": the unit the allocator hands out and the movers copy

A sequence's block table lists its slots in order, so token t lives at
``kv_pool[block_table[t // page_tokens], l, :, t % page_tokens]``.

Two kernels, each with its torch ``*_ref`` (the CPU path, same semantics):

* ``rope_and_cache``: one pass over a step's fused QKV projection: rotates Q into ``q_out``,
  rotates K and stores K and V straight into their pool pages. Bytes: read the QKV rows once,
  write Q once and K/V once; it replaces ~9 small torch launches per layer.
* ``paged_decode_attention``: one query token per sequence against its pages. A program owns one
  (sequence, KV head, split of SPLIT_TOKENS tokens) and all GROUP query heads of that KV head, so
  each K/V page is read from HBM once per step, not once per query head. Bytes per step =
  Σ context_len × 2 × num_kv_heads × head_dim × elem: the kernel is bandwidth-bound and its
  speed is that sum over HBM bandwidth.

NOTE (determinism): splits have a fixed size in tokens (never a function of the batch), pages
are visited in order, and the partial results are combined by a second kernel in split order
(no atomics). A sequence's output therefore depends only on its own query and pool bytes: the
same bytes in the pool give the same bits, whatever else shares the batch, whether those bytes
were computed in this process or restored from a copy.
"""
from __future__ import annotations

import math

import torch

from residency.kernels._common import SUM_COMBINE, KernelInputError, dual_mode_kernel, next_pow2, tl, use_triton

try:
    # Reductions go through ``tl.reduce`` with the library's combine functions: ``tl.max`` and
    # ``tl.sum`` are JIT functions built at import and fail in an interpreter switched on later,
    # while the interpreter recognises these combine functions (see kernels._common.SUM_COMBINE).
    from triton.language.standard import _elementwise_max as MAX_COMBINE
except ImportError:  # pragma: no cover - CPU-only host without triton: the refs run
    MAX_COMBINE = None

SPLIT_TOKENS = 256   # tokens per decode program; fixed, so results never depend on batch shape
BLOCK_N = 64         # tokens per inner iteration (may span several pages)
_LOG2E = 1.4426950408889634
ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------ checks
def _check_pool(op: str, kv_pool: torch.Tensor, layer: int) -> None:
    if not isinstance(kv_pool, torch.Tensor) or kv_pool.dim() != 6:
        shape = tuple(kv_pool.shape) if isinstance(kv_pool, torch.Tensor) else type(kv_pool).__name__
        raise KernelInputError(
            f"{op}: kv_pool must be 6-D [num_blocks, num_layers, 2, page_tokens, num_kv_heads, head_dim], got {shape}")
    if kv_pool.shape[2] != 2:
        raise KernelInputError(f"{op}: kv_pool dim 2 must be 2 (K, V), got {kv_pool.shape[2]}")
    if kv_pool.dtype not in ATTN_DTYPES:
        raise KernelInputError(f"{op}: kv_pool dtype {kv_pool.dtype} is not supported (float32, float16, bfloat16)")
    if kv_pool.stride(-1) != 1:
        raise KernelInputError(f"{op}: kv_pool must have unit stride along head_dim, got strides {kv_pool.stride()}")
    if not 0 <= layer < kv_pool.shape[1]:
        raise KernelInputError(f"{op}: layer {layer} out of range [0, {kv_pool.shape[1]})")


def _check_index(op: str, name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"{op}: {name} must be an int32/int64 tensor")
    if t.dim() != dim:
        raise KernelInputError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise KernelInputError(f"{op}: {name} is on {t.device}, the pool on {device}")
    if t.numel() and t.stride(-1) != 1:
        raise KernelInputError(f"{op}: {name} must be contiguous along its last dim, got strides {t.stride()}")


# ------------------------------------------------------------------ RoPE + cache write
def _rope_and_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, off_ptr, pool_ptr, q_out_ptr,
    stride_qkv, stride_cos, stride_qo_t, stride_qo_h,
    stride_pb, stride_pkv, stride_pt, stride_ph,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0)              # token row of the step
    h = tl.program_id(1)              # 0..NUM_HEADS-1: a Q head; then the KV heads
    d = tl.arange(0, HALF_PAD)
    dm = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dm, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dm, other=0.0)
    row = qkv_ptr + t.to(tl.int64) * stride_qkv + h * (2 * HALF)
    x1 = tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if h < NUM_HEADS:
        dst = q_out_ptr + t.to(tl.int64) * stride_qo_t + h * stride_qo_h
        tl.store(dst + d, o1.to(q_out_ptr.dtype.element_ty), mask=dm)
        tl.store(dst + HALF + d, o2.to(q_out_ptr.dtype.element_ty), mask=dm)
    else:
        kvh = h - NUM_HEADS
        slot = tl.load(slot_ptr + t).to(tl.int64)
        off = tl.load(off_ptr + t).to(tl.int64)
        wm = dm & (slot >= 0)                          # slot -1: a padding row of a graph writes nothing
        slot = tl.maximum(slot, 0)
        dst = pool_ptr + slot * stride_pb + off * stride_pt + kvh * stride_ph
        tl.store(dst + d, o1.to(pool_ptr.dtype.element_ty), mask=wm)
        tl.store(dst + HALF + d, o2.to(pool_ptr.dtype.element_ty), mask=wm)
        vrow = row + NUM_KV_HEADS * (2 * HALF)         # V head kvh sits NUM_KV_HEADS heads after K head kvh
        v1 = tl.load(vrow + d, mask=dm, other=0.0)
        v2 = tl.load(vrow + HALF + d, mask=dm, other=0.0)
        tl.store(dst + stride_pkv + d, v1.to(pool_ptr.dtype.element_ty), mask=wm)
        tl.store(dst + stride_pkv + HALF + d, v2.to(pool_ptr.dtype.element_ty), mask=wm)


_rope_and_cache = dual_mode_kernel(_rope_and_cache_kernel)


def rope_and_cache(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, offsets: torch.Tensor, kv_pool: torch.Tensor, layer: int,
    num_heads: int, q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate Q into ``q_out`` [T, num_heads, head_dim]; rotate K and write K, V of token i to
    ``kv_pool[slots[i], layer, :, offsets[i]]``. Returns ``q_out``.

    ``qkv`` [T, (num_heads + 2·num_kv_heads)·head_dim] (rows Q|K|V, heads contiguous), ``cos``/
    ``sin`` [max_pos, head_dim/2] float32, ``positions``/``slots``/``offsets`` [T] ints.
    Rotation is transformers' (halves): (x1, x2) -> (x1·c − x2·s, x2·c + x1·s), in float32.
    A token whose slot is -1 writes no K/V (its Q is still rotated): the padding rows of a
    CUDA graph captured for a larger batch than the step runs.
    """
    op = "rope_and_cache"
    _check_pool(op, kv_pool, layer)
    num_kv, hd = kv_pool.shape[4], kv_pool.shape[5]
    dev = kv_pool.device
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv) * hd or qkv.stride(1) != 1:
        raise KernelInputError(f"{op}: qkv must be [T, {(num_heads + 2 * num_kv) * hd}] with unit last stride, "
                               f"got shape {tuple(qkv.shape)} strides {qkv.stride()}")
    if qkv.dtype not in ATTN_DTYPES or qkv.device != dev:
        raise KernelInputError(f"{op}: qkv {qkv.dtype} on {qkv.device}; need float dtype on {dev}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != hd // 2 or t.stride(1) != 1 or t.device != dev:
            raise KernelInputError(f"{op}: {name} must be float32 [max_pos, {hd // 2}] contiguous on {dev}")
    T = qkv.shape[0]
    for name, t in (("positions", positions), ("slots", slots), ("offsets", offsets)):
        _check_index(op, name, t, 1, dev)
        if t.shape[0] != T:
            raise KernelInputError(f"{op}: {name} has {t.shape[0]} entries for {T} tokens")
    if q_out is None:
        q_out = torch.empty(T, num_heads, hd, dtype=qkv.dtype, device=dev)
    elif q_out.shape != (T, num_heads, hd) or q_out.stride(2) != 1:
        raise KernelInputError(f"{op}: q_out must be [{T}, {num_heads}, {hd}] with unit last stride")
    if T == 0:
        return q_out
    if not use_triton(dev):
        return rope_and_cache_ref(qkv, cos, sin, positions, slots, offsets, kv_pool, layer, num_heads, q_out)
    pl = kv_pool[:, layer]
    _rope_and_cache[(T, num_heads + num_kv)](
        qkv, cos, sin, positions, slots, offsets, pl, q_out,
        qkv.stride(0), cos.stride(0), q_out.stride(0), q_out.stride(1),
        pl.stride(0), pl.stride(1), pl.stride(2), pl.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv, HALF=hd // 2, HALF_PAD=next_pow2(hd // 2),
    )
    return q_out


def rope_and_cache_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, offsets: torch.Tensor, kv_pool: torch.Tensor, layer: int,
    num_heads: int, q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference (and CPU path) of ``rope_and_cache``."""
    num_kv, hd = kv_pool.shape[4], kv_pool.shape[5]
    T = qkv.shape[0]
    x = qkv.view(T, num_heads + 2 * num_kv, hd)
    qk = x[:, : num_heads + num_kv].float()
    pos = positions.long()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    x1, x2 = qk[..., : hd // 2], qk[..., hd // 2:]
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    if q_out is None:
        q_out = torch.empty(T, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    q_out.copy_(rot[:, :num_heads])
    sl, of = slots.long(), offsets.long()
    keep = sl >= 0                                     # slot -1 writes nothing (graph padding)
    if not bool(keep.all()):
        sl, of, rot, x = sl[keep], of[keep], rot[keep], x[keep]
    kv_pool[sl, layer, 0, of] = rot[:, num_heads:].to(kv_pool.dtype)
    kv_pool[sl, layer, 1, of] = x[:, num_heads + num_kv:].to(kv_pool.dtype)
    return q_out


# ------------------------------------------------------------------ decode attention
def _paged_decode_kernel(
    q_ptr, pool_ptr, bt_ptr, ctx_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_pb, stride_pkv, stride_pt, stride_ph, stride_btb,
    stride_ob, stride_oh, stride_pmb, stride_pmh, stride_pab, stride_pah, stride_pas,
    PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = sp * SPLIT
    if start < ctx:                                   # splits past the context do nothing
        num_splits = (ctx + SPLIT - 1) // SPLIT
        end = tl.minimum(start + SPLIT, ctx)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gm = g < GROUP
        dm = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
        acc = tl.full([GROUP_PAD, D_PAD], 0.0, tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            nm = n < end
            slot = tl.load(bt_row + n // PAGE, mask=nm, other=0).to(tl.int64)
            base = slot * stride_pb + (n % PAGE).to(tl.int64) * stride_pt + kvh * stride_ph
            kvm = nm[:, None] & dm[None, :]
            k = tl.load(pool_ptr + base[:, None] + d[None, :], mask=kvm, other=0.0)
            v = tl.load(pool_ptr + stride_pkv + base[:, None] + d[None, :], mask=kvm, other=0.0)
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(nm[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        om = gm[:, None] & dm[None, :]
        if num_splits == 1:
            o = acc / l_i[:, None]
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=om)
        else:
            pm = b.to(tl.int64) * stride_pmb + heads * stride_pmh + sp
            tl.store(pm_ptr + pm, m_i, mask=gm)
            tl.store(pl_ptr + pm, l_i, mask=gm)
            pa = b.to(tl.int64) * stride_pab + heads[:, None] * stride_pah + sp * stride_pas + d[None, :]
            tl.store(pacc_ptr + pa, acc, mask=om)


def _paged_decode_reduce_kernel(
    out_ptr, pm_ptr, pl_ptr, pacc_ptr, ctx_ptr,
    stride_ob, stride_oh, stride_pmb, stride_pmh, stride_pab, stride_pah, stride_pas,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    num_splits = (ctx + SPLIT - 1) // SPLIT
    if num_splits > 1:                                # one split was written out directly
        d = tl.arange(0, D_PAD)
        dm = d < HEAD_DIM
        pm = pm_ptr + b.to(tl.int64) * stride_pmb + h * stride_pmh
        pl = pl_ptr + b.to(tl.int64) * stride_pmb + h * stride_pmh
        pa = pacc_ptr + b.to(tl.int64) * stride_pab + h * stride_pah
        m = tl.load(pm)
        l_sum = tl.load(pl)
        acc = tl.load(pa + d, mask=dm, other=0.0)
        for s in range(1, num_splits):                # split order: fixed, no atomics
            ms = tl.load(pm + s)
            m_new = tl.maximum(m, ms)
            a_old = tl.exp2(m - m_new)
            a_new = tl.exp2(ms - m_new)
            l_sum = l_sum * a_old + tl.load(pl + s) * a_new
            acc = acc * a_old + tl.load(pa + s * stride_pas + d, mask=dm, other=0.0) * a_new
            m = m_new
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
                 (acc / l_sum).to(out_ptr.dtype.element_ty), mask=dm)


_paged_decode = dual_mode_kernel(_paged_decode_kernel)
_paged_decode_reduce = dual_mode_kernel(_paged_decode_reduce_kernel)


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, sm_scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context.

    ``q`` [B, num_heads, head_dim] (the query at position context_lens[b]-1, RoPE applied; its K/V
    already in the pool), ``block_tables`` [B, max_blocks] slot indices (entries past a sequence's
    context are never read), ``context_lens`` [B] ≥ 1. Returns ``out`` [B, num_heads, head_dim].
    Query head h reads KV head h // (num_heads // num_kv_heads), as transformers' ``repeat_kv``.
    Refuses by name: wrong ranks, dtypes or devices, non-unit inner strides, head counts that do
    not divide, head_dim > 256.
    """
    op = "paged_decode_attention"
    _check_pool(op, kv_pool, layer)
    dev = kv_pool.device
    B, nh, hd = _check_decode_inputs(op, q, kv_pool, block_tables, context_lens)
    num_kv, page = kv_pool.shape[4], kv_pool.shape[3]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(hd)
    if out is None:
        out = torch.empty(B, nh, hd, dtype=q.dtype, device=dev)
    elif out.shape != (B, nh, hd) or out.stride(2) != 1 or out.dtype != q.dtype:
        raise KernelInputError(f"{op}: out must be [{B}, {nh}, {hd}] {q.dtype} with unit last stride")
    if B == 0:
        return out
    if dev.type != "cuda":
        _check_context_fits(op, block_tables, context_lens, page)
        if not use_triton(dev):
            return paged_decode_attention_ref(q, kv_pool, layer, block_tables, context_lens, scale, out)
    group = nh // num_kv
    max_splits = max(1, -(-block_tables.shape[1] * page // SPLIT_TOKENS))
    # Partials for sequences longer than one split; allocated per call (graph-capture safe).
    pm = torch.empty(B, nh, max_splits, dtype=torch.float32, device=dev)
    pls = torch.empty(B, nh, max_splits, dtype=torch.float32, device=dev)
    pacc = torch.empty(B, nh, max_splits, hd, dtype=torch.float32, device=dev)
    pl = kv_pool[:, layer]
    _paged_decode[(B, num_kv, max_splits)](
        q, pl, block_tables, context_lens, out, pm, pls, pacc,
        scale * _LOG2E,
        q.stride(0), q.stride(1), pl.stride(0), pl.stride(1), pl.stride(2), pl.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        pm.stride(0), pm.stride(1), pacc.stride(0), pacc.stride(1), pacc.stride(2),
        PAGE=page, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=hd,
        D_PAD=max(16, next_pow2(hd)), BLOCK=BLOCK_N, SPLIT=SPLIT_TOKENS,
        # float32 pools, and the interpreter (whose tl.dot mis-reads bfloat16), dot in float32;
        # half-precision pools on the GPU use the tensor cores with float32 accumulation.
        FP32_DOT=q.dtype == torch.float32 or dev.type != "cuda",
    )
    if max_splits > 1:
        _paged_decode_reduce[(B, nh)](
            out, pm, pls, pacc, context_lens,
            out.stride(0), out.stride(1), pm.stride(0), pm.stride(1),
            pacc.stride(0), pacc.stride(1), pacc.stride(2),
            HEAD_DIM=hd, D_PAD=max(16, next_pow2(hd)), SPLIT=SPLIT_TOKENS,
        )
    return out


def _check_decode_inputs(op, q, kv_pool, block_tables, context_lens) -> tuple[int, int, int]:
    dev = kv_pool.device
    num_kv, hd = kv_pool.shape[4], kv_pool.shape[5]
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != hd:
        raise KernelInputError(f"{op}: q must be [B, num_heads, {hd}], got "
                               f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype != kv_pool.dtype:
        raise KernelInputError(f"{op}: q dtype {q.dtype} differs from kv_pool dtype {kv_pool.dtype}")
    if q.device != dev:
        raise KernelInputError(f"{op}: q is on {q.device}, kv_pool on {dev}")
    if q.stride(2) != 1:
        raise KernelInputError(f"{op}: q must have unit stride along head_dim, got strides {q.stride()}")
    B, nh, _ = q.shape
    if nh % num_kv:
        raise KernelInputError(f"{op}: num_heads {nh} is not a multiple of num_kv_heads {num_kv}")
    if hd > 256:
        raise KernelInputError(f"{op}: head_dim {hd} > 256 is not supported")
    _check_index(op, "block_tables", block_tables, 2, dev)
    _check_index(op, "context_lens", context_lens, 1, dev)
    if block_tables.shape[0] != B or context_lens.shape[0] != B:
        raise KernelInputError(f"{op}: {B} queries, {block_tables.shape[0]} block tables, "
                               f"{context_lens.shape[0]} context lengths")
    return B, nh, hd


def _check_context_fits(op: str, block_tables: torch.Tensor, context_lens: torch.Tensor, page: int) -> None:
    """Host-side bounds check (never on CUDA tensors: it would cost a sync per step)."""
    if context_lens.numel() and (int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * page):
        raise KernelInputError(f"{op}: context_lens must lie in [1, {block_tables.shape[1] * page}], "
                               f"got {context_lens.tolist()[:8]}")


def paged_decode_attention_ref(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, sm_scale: float | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference (and CPU path): gather every page of the table, mask past the
    context, softmax in float32. Positions past the context may hold anything (even NaN)."""
    B, nh, hd = q.shape
    num_blocks, page, num_kv = kv_pool.shape[0], kv_pool.shape[3], kv_pool.shape[4]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(hd)
    L = block_tables.shape[1] * page
    bt = block_tables.long().clamp(0, num_blocks - 1)
    k = kv_pool[bt, layer, 0].reshape(B, L, num_kv, hd).float()
    v = kv_pool[bt, layer, 1].reshape(B, L, num_kv, hd).float()
    valid = torch.arange(L, device=q.device)[None, :] < context_lens.long()[:, None]      # [B, L]
    v = torch.where(valid[:, :, None, None], v, 0.0)
    qf = q.float().view(B, num_kv, nh // num_kv, hd)
    s = torch.einsum("bngd,blnd->bngl", qf, k) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bngl,blnd->bngd", torch.softmax(s, dim=-1), v).reshape(B, nh, hd)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
