"""The runner's attention over pool pages: prefill through SDPA, and the batch-invariant path.

Both read K/V from the pool pages *after* the step's new K/V were written there, so a prefill
that finds its prefix already cached (computed now, or restored from a copy) and a full prefill
read the same bytes for the same positions.

* ``paged_prefill_attention``: the fast path for a sequence with several new tokens: gather its
  pages into contiguous K/V, one SDPA call with a lower-right causal mask (query i at position
  start+i sees keys 0..start+i).
* ``paged_attention_invariant``: every query row, decode or prefill, through the same
  fixed-shape computation (query tiles of Q_TILE rows, key chunks of KV_CHUNK tokens starting at
  absolute position 0, online softmax). A row's result depends only on its query and the keys at
  positions ≤ its own, never on how many rows, sequences or later keys share the step; chunks
  past a row's position contribute exact zeros. This is the numerics that makes "prefill A+B"
  and "prefill A, then B over cached pages" agree bit for bit (with the runner's tiled matmuls).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Q_TILE = 16
KV_CHUNK = 256


def gather_pages(kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor, ctx_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, ctx_len) as contiguous [ctx_len, num_kv_heads, head_dim]."""
    page, num_kv, hd = kv_pool.shape[3], kv_pool.shape[4], kv_pool.shape[5]
    nb = -(-ctx_len // page)
    kv = kv_pool[block_table[:nb], layer]                      # [nb, 2, page, kv, hd]
    k = kv[:, 0].reshape(nb * page, num_kv, hd)[:ctx_len]
    v = kv[:, 1].reshape(nb * page, num_kv, hd)[:ctx_len]
    return k, v


def paged_prefill_attention(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                            start_pos: int, ctx_len: int, sm_scale: float) -> torch.Tensor:
    """``q`` [M, num_heads, head_dim] at positions start_pos..ctx_len-1 -> [M, num_heads, head_dim]."""
    M, nh, hd = q.shape
    k, v = gather_pages(kv_pool, layer, block_table, ctx_len)
    gqa = True
    if q.is_cuda and k.shape[1] != nh:
        # NOTE: on CUDA, SDPA's flash / memory-efficient kernels are picked only for equal head
        # counts on every path we use (the lower-right causal bias dispatches to them directly);
        # the fallback materialises [heads, M, ctx] scores, 9 GB per layer at 8k. Expanding K/V
        # costs ~2·heads·ctx·head_dim·2 bytes per layer, a millisecond for a whole 8k prefill.
        k = k.repeat_interleave(nh // k.shape[1], dim=1)
        v = v.repeat_interleave(nh // v.shape[1], dim=1)
        gqa = False
    qh = q.transpose(0, 1).unsqueeze(0)                        # [1, nh, M, hd]
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if start_pos == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale, enable_gqa=gqa)
    elif q.is_cuda:
        # NOTE: torch's CausalBias reaches the flash / memory-efficient kernels with a lower-right
        # mask on CUDA; importing it imports torch._dynamo (seconds on a busy host), which the
        # runner pays when it is built on a GPU (``ModelRunner``), not on a first reused prefix.
        from torch.nn.attention.bias import causal_lower_right
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(M, ctx_len),
                                           scale=sm_scale, enable_gqa=gqa)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=lower_right_mask(M, ctx_len, q.device),
                                           scale=sm_scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def lower_right_mask(num_queries: int, ctx_len: int, device) -> torch.Tensor:
    """[num_queries, ctx_len] bool: query i, at position ctx_len - num_queries + i, sees keys
    0..that position. The mask torch's CausalBias builds for SDPA off CUDA, built here without
    importing it.

        ctx_len = 6, num_queries = 2:   1 1 1 1 1 0
                                        1 1 1 1 1 1
    """
    return torch.ones(num_queries, ctx_len, dtype=torch.bool, device=device).tril(diagonal=ctx_len - num_queries)


def paged_attention_invariant(q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_table: torch.Tensor,
                              start_pos: int, ctx_len: int, sm_scale: float) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention`` (also for M = 1), computed batch-invariantly.

        keys:    |---- chunk 0 ----|---- chunk 1 ----|-- chunk 2 (zero-padded) --|
        row at position p runs chunks 0..p // KV_CHUNK; any later chunk the tile runs is
        fully masked for it: m unchanged, alpha = 1, p = 0, so l and acc stay bit-identical.
    """
    M, nh, hd = q.shape
    num_kv = kv_pool.shape[4]
    g = nh // num_kv
    n_chunks_total = -(-ctx_len // KV_CHUNK)
    k, v = gather_pages(kv_pool, layer, block_table, ctx_len)
    kp = torch.zeros(n_chunks_total * KV_CHUNK, num_kv, hd, dtype=torch.float32, device=q.device)
    vp = torch.zeros_like(kp)
    kp[:ctx_len] = k
    vp[:ctx_len] = v
    kc = kp.permute(1, 2, 0).contiguous()                       # [kv, hd, Lp]
    vc = vp.permute(1, 0, 2).contiguous()                       # [kv, Lp, hd]
    n_tiles = -(-M // Q_TILE)
    qf = torch.zeros(n_tiles * Q_TILE, nh, hd, dtype=torch.float32, device=q.device)
    qf[:M] = q
    pos = torch.zeros(n_tiles * Q_TILE, dtype=torch.int64, device=q.device)
    pos[:M] = torch.arange(start_pos, start_pos + M, device=q.device)
    out = torch.empty(n_tiles * Q_TILE, nh, hd, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(KV_CHUNK, device=q.device)
    for t in range(n_tiles):
        rows = slice(t * Q_TILE, (t + 1) * Q_TILE)
        # [Q_TILE, kv, g, hd] -> [kv, g·Q_TILE, hd]: one fixed-shape bmm per chunk
        qt = qf[rows].view(Q_TILE, num_kv, g, hd).permute(1, 2, 0, 3).reshape(num_kv, g * Q_TILE, hd)
        rp = pos[rows].repeat(g)                                # row (gi, ti) has position of ti
        m = torch.full((num_kv, g * Q_TILE), float("-inf"), device=q.device)
        l = torch.zeros(num_kv, g * Q_TILE, device=q.device)
        acc = torch.zeros(num_kv, g * Q_TILE, hd, device=q.device)
        last = int(pos[rows][: max(0, min(Q_TILE, M - t * Q_TILE))].max()) // KV_CHUNK
        for c in range(last + 1):
            cs = slice(c * KV_CHUNK, (c + 1) * KV_CHUNK)
            s = torch.bmm(qt, kc[:, :, cs]) * sm_scale
            s = s.masked_fill((c * KV_CHUNK + key_pos)[None, None, :] > rp[None, :, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, vc[:, cs])
            m = m_new
        o = acc / l[..., None]                                  # [kv, g·Q_TILE, hd]
        out[rows] = o.view(num_kv, g, Q_TILE, hd).permute(2, 0, 1, 3).reshape(Q_TILE, nh, hd)
    return out[:M].to(q.dtype)


def tiled_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, tile: int = Q_TILE
                 ) -> torch.Tensor:
    """``x @ w.T`` computed in fixed tiles of ``tile`` rows (the last one zero-padded).

    NOTE: BLAS picks its kernel and blocking from the matrix shape, so the bits of a row of
    ``x @ w.T`` change with the number of rows (measured on MKL: M = 1..9 all differ). With every
    call the same [tile, K] × [K, N] shape, a row's bits depend only on the row.
    """
    M = x.shape[0]
    n_tiles = -(-M // tile)
    xp = x if M == n_tiles * tile else torch.cat([x, x.new_zeros(n_tiles * tile - M, x.shape[1])])
    out = torch.empty(n_tiles * tile, w.shape[0], dtype=x.dtype, device=x.device)
    wt = w.t()
    for i in range(n_tiles):
        torch.matmul(xp[i * tile:(i + 1) * tile], wt, out=out[i * tile:(i + 1) * tile])
    if bias is not None:
        out += bias
    return out[:M]
