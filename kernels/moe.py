"""A fused mixture-of-experts MLP: route, group the tokens by expert, two grouped GEMM launches.

    out[t] = Σ_{j < top_k}  w[t, j] · down_e( silu(gate_e(x[t])) · up_e(x[t]) ),   e = experts[t, j]

The family served is OLMoE (see ``residency.dataplane.model.config``): a softmax over the
router's logits in float32, the ``top_k`` largest probabilities kept, renormalised to sum to one
only when the family asks (``norm_topk_prob``; OLMoE-1B-7B does not), no shared expert.

Weights are stacked per layer as transformers keeps them in memory:

    w_gate_up [E, 2·I, H]   rows of expert e: gate | up
    w_down    [E, H, I]

Steps of ``fused_moe``:
 1. ``route``: router logits, softmax, top-k, optional renormalisation (torch: [T, E] is tiny).
 2. ``align_by_expert``: the T·top_k (token, slot) pairs sorted by expert, each expert's run
    padded up to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert:

        pairs sorted by expert    e0 e0 e0 | e3 | e5 e5 e5 e5 e5        (BLOCK_M = 4)
        sorted_pairs (padded)     p p p -  | p - - - | p p p p | p - - -     (- = sentinel T·top_k)
        block_expert              0        | 3       | 5       | 5

    Computed on the device without a host sync: the buffers have their worst-case length
    T·top_k + min(E, T·top_k)·(BLOCK_M − 1) and the real length is a device scalar the kernel
    reads, so blocks past it return at once (and a CUDA graph can capture the whole thing).
 3. ONE launch of ``_moe_gemm_kernel`` for gate_up over every (block, N-tile): row r of a block
    reads activation row pair // top_k and expert block_expert's matrix.
 4. silu(gate) · up (torch, elementwise).
 5. ONE launch for down, each output row scaled by its routing weight, then the top_k rows of a
    token summed.

Why it is fast: at decode the MLP is bandwidth-bound on expert weights. A program streams the
[BLOCK_N, K] slice of ONE expert's matrix once for up to BLOCK_M rows routed to it, so a step
reads each *routed* expert's bytes once (≈ experts hit × 3·H·I·elem per layer) and never an
expert nobody chose; a per-expert loop of dense matmuls reads the same bytes but pays one launch
(and a host sync to find the hit experts) per expert per layer. Activation traffic is
T·top_k·(H + 2I + I + H)·elem, small next to the weights until the batch is large.

Where it runs (as every kernel here): CUDA tensors → the compiled kernel; CPU tensors with
TRITON_INTERPRET=1 → the same kernel interpreted (tests); CPU otherwise → ``fused_moe_ref``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from residency.kernels._common import KernelInputError, dual_mode_kernel, tl, use_triton

MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 16          # rows (token, slot pairs) of one expert per program; tl.dot needs ≥ 16
BLOCK_N = 64
BLOCK_K = 64


# ------------------------------------------------------------------ routing
def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
          linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in x's dtype, experts [T, top_k] int64), as OLMoE's router computes
    them: logits in x's dtype, softmax in float32, top-k, optional renormalisation, cast back."""
    logits = linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, *,
                    last_is_skipped: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened (token, slot) pairs by expert and pad each expert's run to ``block_m``.

    Returns ``sorted_pairs`` [L] int32 (pair index t·top_k + j, or the sentinel T·top_k in the
    padding), ``block_expert`` [L // block_m] int32 (the expert of each block; −1 past the end)
    and ``num_padded`` [1] int32 (rows in use, a multiple of ``block_m``). L is the worst case,
    so nothing here waits for the device.

    ``last_is_skipped``: expert ``num_experts − 1`` is a sentinel for pairs left out of this
    launch; its run sorts last, so ``num_padded`` stops where it starts and no block reads it.
    """
    flat = experts.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    max_padded = n + min(num_experts, n) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)                      # pair indices, grouped by expert
    by_expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[by_expert]
    dest = (padded_end - padded)[by_expert] + rank
    sorted_pairs = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    num_padded = padded_end[-2:-1] if last_is_skipped else padded_end[-1:]
    block_expert = torch.where(block_start < num_padded, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, num_padded.to(torch.int32)


# ------------------------------------------------------------------ grouped GEMM
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, rw_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_am, stride_we, stride_wn, stride_cm,
    TOP_K: tl.constexpr, A_ROW_IS_PAIR: tl.constexpr, MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """c[pair, n] = (rw[pair] ·) Σ_k a[row(pair), k] · w[e, n, k] for the rows of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M < num_padded:                  # blocks past the padded end do nothing
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < num_pairs                      # the padding carries the sentinel num_pairs
        if A_ROW_IS_PAIR:
            a_row = pair.to(tl.int64)
        else:
            a_row = (pair // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cm = cols < N
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        w_base = w_ptr + e * stride_we
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = ks < K
            a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :], mask=valid[:, None] & km[None, :],
                        other=0.0)
            b = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=km[:, None] & cm[None, :],
                        other=0.0)
            if FP32_DOT:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if MUL_ROUTING_WEIGHT:
            rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            acc = acc * rw[:, None]
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & cm[None, :])


_moe_gemm = dual_mode_kernel(_moe_gemm_kernel)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, routing_weights: torch.Tensor,
                  sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
                  top_k: int, a_row_is_pair: bool, mul_routing_weight: bool) -> torch.Tensor:
    E, N, K = w.shape
    grid = (block_expert.numel(), -(-N // BLOCK_N))
    _moe_gemm[grid](
        a, w, out, routing_weights, sorted_pairs, block_expert, num_padded,
        N, K, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_ROW_IS_PAIR=a_row_is_pair, MUL_ROUTING_WEIGHT=mul_routing_weight,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # float32 weights, and the interpreter (whose tl.dot mis-reads bfloat16), dot in float32;
        # half-precision weights on the GPU use the tensor cores with float32 accumulation.
        FP32_DOT=w.dtype == torch.float32 or not w.is_cuda,
    )
    return out


# ------------------------------------------------------------------ public
def _check(op: str, x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
           top_k: int) -> None:
    for name, t, dim in (("x", x, 2), ("router", router, 2), ("w_gate_up", w_gate_up, 3), ("w_down", w_down, 3)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dim:
            raise KernelInputError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in MOE_DTYPES:
            raise KernelInputError(f"{op}: {name} dtype {t.dtype} is not supported (float32, float16, bfloat16)")
        if t.dtype != x.dtype:
            raise KernelInputError(f"{op}: {name} dtype {t.dtype} differs from x's {x.dtype}")
        if t.device != x.device:
            raise KernelInputError(f"{op}: {name} is on {t.device}, x on {x.device}")
        if t.numel() and t.stride(-1) != 1:
            raise KernelInputError(f"{op}: {name} must have unit stride along its last dim, got strides {t.stride()}")
    T, H = x.shape
    E = router.shape[0]
    if router.shape[1] != H:
        raise KernelInputError(f"{op}: router must be [num_experts, {H}], got {tuple(router.shape)}")
    if w_gate_up.shape[0] != E or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise KernelInputError(f"{op}: w_gate_up must be [{E}, 2·intermediate, {H}], got {tuple(w_gate_up.shape)}")
    inter = w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (E, H, inter):
        raise KernelInputError(f"{op}: w_down must be [{E}, {H}, {inter}], got {tuple(w_down.shape)}")
    if not 1 <= top_k <= E:
        raise KernelInputError(f"{op}: top_k {top_k} must lie in [1, num_experts={E}]")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.stride(1) != t.shape[2] or t.stride(0) != t.shape[1] * t.shape[2]:
            raise KernelInputError(f"{op}: {name} must be contiguous, got strides {t.stride()}")


def fused_moe(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """The MoE MLP of ``x`` [T, H] -> [T, H] (see the module docstring for the steps).

    Refuses (``KernelInputError``, naming the argument): wrong ranks, unsupported or mixed dtypes,
    mixed devices, non-unit inner strides, non-contiguous expert stacks, shapes that disagree
    (router [E, H], w_gate_up [E, 2I, H], w_down [E, H, I]), top_k outside [1, E].
    """
    op = "fused_moe"
    _check(op, x, router, w_gate_up, w_down, top_k)
    T, H = x.shape
    if T == 0:
        return x.new_empty(0, H)
    if not use_triton(x.device):
        return fused_moe_ref(x, router, w_gate_up, w_down, top_k, renormalize)
    weights, experts = route(x, router, top_k, renormalize)
    rows = torch.empty(T * top_k, H, dtype=x.dtype, device=x.device)
    fused_moe_rows(x, weights, experts, w_gate_up, w_down, rows)
    return rows.view(T, top_k, H).sum(dim=1)


def fused_moe_rows(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, out: torch.Tensor, *, skip_id: int | None = None) -> torch.Tensor:
    """The expert half of ``fused_moe`` over routing already made (the Triton path only).

    ``experts`` [T, top_k] index the stacks' first dimension: expert ids, or the device slots
    holding them (an offloaded layer, dataplane/model/experts.py). Writes row t·top_k + j of
    ``out`` [T·top_k, H] = weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t])); the caller
    sums each token's ``top_k`` rows. Pairs whose index is ``skip_id`` (which must be
    ``w_gate_up.shape[0]``, one past the last stack) are not computed and their rows of ``out``
    are left as they were: a layer whose experts do not all fit the device at once runs in passes
    that write disjoint rows. Each row's arithmetic is the same whichever stack index or pass it
    gets, so the rows equal ``fused_moe``'s bit for bit.
    """
    T, H = x.shape
    top_k = experts.shape[1]
    E, two_i, _ = w_gate_up.shape
    if skip_id is not None and skip_id != E:
        raise KernelInputError(f"fused_moe_rows: skip_id must be {E} (one past the last stack), got {skip_id}")
    if tuple(out.shape) != (T * top_k, H) or out.dtype != x.dtype or not out.is_contiguous():
        raise KernelInputError(f"fused_moe_rows: out must be a contiguous [{T * top_k}, {H}] {x.dtype}, "
                               f"got {tuple(out.shape)} {out.dtype}")
    skipped = skip_id is not None
    sorted_pairs, block_expert, num_padded = align_by_expert(experts, E + skipped, last_is_skipped=skipped)
    pairs = T * top_k
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, weights, sorted_pairs, block_expert, num_padded, top_k,
                  a_row_is_pair=False, mul_routing_weight=False)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()       # rows of skipped pairs are garbage, and never read
    _grouped_gemm(act, w_down, out, weights.reshape(-1).contiguous(), sorted_pairs, block_expert, num_padded,
                  top_k, a_row_is_pair=True, mul_routing_weight=True)
    return out


def fused_moe_ref(x: torch.Tensor, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  top_k: int, renormalize: bool,
                  linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """The torch reference (and CPU path): the same routing, then a loop over the experts that
    were hit, each a dense gate_up, silu·up, down over the rows routed to it, scaled by their
    routing weights and added into the output. ``linear`` lets the batch-invariant runner pass
    its fixed-tile matmul."""
    E = w_gate_up.shape[0]
    weights, experts = route(x, router, top_k, renormalize, linear)
    out = torch.zeros_like(x)
    counts = torch.bincount(experts.reshape(-1), minlength=E).tolist()
    accumulate_experts_ref(x, weights, experts, w_gate_up, w_down, out, [i for i, c in enumerate(counts) if c],
                           linear=linear)
    return out


def accumulate_experts_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                           w_down: torch.Tensor, out: torch.Tensor, hit: Sequence[int],
                           index_of: Callable[[int], int] | None = None,
                           linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> None:
    """The reference's loop over ``hit`` (expert ids, ascending) added into ``out`` [T, H]: each a
    dense gate_up, silu·up, down over the rows routed to it, scaled by their routing weights.
    ``index_of(e)``: where expert e's matrices sit in the stacks (a device slot); default e.

    NOTE: float addition is not associative, so ``out`` is the reference's bit for bit only if
    the experts are added in ascending id order: a layer run in passes must pass ascending,
    consecutive runs of its hit experts."""
    for e in hit:
        i = e if index_of is None else index_of(e)
        tok, slot = torch.where(experts == e)
        gate, up = linear(x[tok], w_gate_up[i]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w_down[i]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
