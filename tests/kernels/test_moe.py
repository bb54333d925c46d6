"""The fused MoE kernel against its torch reference, and the reference against transformers' own
OLMoE sparse MoE block.

Irregular token counts: 1 (a decode), a count below one block, a count that is not a multiple of
BLOCK_M, and more pairs than experts × BLOCK_M. Fresh random weights every run (the suite's rng).
"""
from __future__ import annotations

import pytest
import torch

from residency.kernels._common import KernelInputError, use_triton
from residency.kernels.moe import BLOCK_M, accumulate_experts_ref, align_by_expert, fused_moe, fused_moe_ref, route

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_moe(gen, device, *, T, H, inter, E, dtype=torch.float32):
    x = torch.randn(T, H, generator=gen).to(dtype)
    router = (torch.randn(E, H, generator=gen) * 0.3).to(dtype)
    w_gate_up = (torch.randn(E, 2 * inter, H, generator=gen) * H ** -0.5).to(dtype)
    w_down = (torch.randn(E, H, inter, generator=gen) * inter ** -0.5).to(dtype)
    return [t.to(device) for t in (x, router, w_gate_up, w_down)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("T,H,inter,E,top_k,renorm", [
    (1, 64, 32, 8, 3, False),          # a decode: one token, three experts
    (5, 48, 40, 16, 4, True),          # fewer rows than one block; H, I not multiples of the tiles
    (BLOCK_M + 3, 64, 96, 6, 2, False),  # a count not a multiple of the block
    (37, 32, 24, 4, 4, True),          # top_k == E: every expert, many blocks each
])
def test_fused_moe_kernel_matches_reference(gen, device, T, H, inter, E, top_k, renorm):
    x, router, gu, down = make_moe(gen, device, T=T, H=H, inter=inter, E=E)
    got = fused_moe(x, router, gu, down, top_k, renorm)
    want = fused_moe_ref(x.cpu(), router.cpu(), gu.cpu(), down.cpu(), top_k, renorm)
    assert got.shape == (T, H) and not got.isnan().any()
    assert rel_err(got.cpu(), want) < TOL[torch.float32]


def test_fused_moe_kernel_in_bfloat16_matches_the_float32_reference(gen, device):
    x, router, gu, down = make_moe(gen, device, T=11, H=64, inter=48, E=8, dtype=torch.bfloat16)
    got = fused_moe(x, router, gu, down, 2, False)
    assert got.dtype == torch.bfloat16
    # the kernel's own routing (bf16 logits: near-tied logits may pick another expert than float32
    # logits would, which is a routing difference, not the kernel's error), everything after in float32
    weights, experts = route(x, router, 2, False)
    xf, guf, downf = x.float().cpu(), gu.float().cpu(), down.float().cpu()
    want = torch.zeros_like(xf)
    hit = sorted(set(experts.reshape(-1).tolist()))
    accumulate_experts_ref(xf, weights.float().cpu(), experts.cpu(), guf, downf, want, hit)
    assert rel_err(got.float().cpu(), want) < TOL[torch.bfloat16]


def test_align_groups_every_pair_once_in_blocks_of_one_expert(gen):
    T, top_k, E = 29, 3, 7
    experts = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
    pairs, block_expert, num_padded = align_by_expert(experts, E)
    n = int(num_padded)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    assert n == int(((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M).sum()) and n % BLOCK_M == 0
    real = pairs[:n][pairs[:n] < T * top_k]
    assert sorted(real.tolist()) == list(range(T * top_k))           # every pair exactly once
    assert (pairs[n:] == T * top_k).all()                            # the tail is padding only
    flat = experts.reshape(-1)
    for b in range(n // BLOCK_M):
        rows = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
        rows = rows[rows < T * top_k].long()
        assert (flat[rows] == int(block_expert[b])).all()
    assert (block_expert[n // BLOCK_M:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [False, True])
def test_reference_matches_transformers_olmoe_sparse_block(gen, dtype, renorm):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    H, inter, E, top_k, T = 48, 32, 12, 4, 19
    cfg = OlmoeConfig(hidden_size=H, intermediate_size=inter, num_experts=E, num_experts_per_tok=top_k,
                      norm_topk_prob=renorm)
    block = OlmoeSparseMoeBlock(cfg).to(dtype)
    x, router, gu, down = make_moe(gen, "cpu", T=T, H=H, inter=inter, E=E, dtype=dtype)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gu)
        block.experts.down_proj.copy_(down)
        want = block(x.view(1, T, H)).view(T, H)
    got = fused_moe_ref(x, router, gu, down, top_k, renorm)
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]


def test_renormalisation_changes_the_output_so_the_comparisons_can_fail(gen):
    x, router, gu, down = make_moe(gen, "cpu", T=6, H=32, inter=16, E=8)
    assert rel_err(fused_moe_ref(x, router, gu, down, 2, True), fused_moe_ref(x, router, gu, down, 2, False)) > 0.05
    w, _ = route(x, router, 2, True)
    assert torch.allclose(w.sum(-1), torch.ones(6))


def test_fused_moe_refuses_bad_inputs_by_name(gen):
    x, router, gu, down = make_moe(gen, "cpu", T=4, H=32, inter=16, E=4)
    cases = [
        ((x.double(), router, gu, down, 2), "x dtype torch.float64"),
        ((x, router.bfloat16(), gu, down, 2), "router dtype torch.bfloat16 differs"),
        ((x, router[:, :16], gu, down, 2), "router must be"),
        ((x, router, gu[:, :31], down, 2), "w_gate_up must be"),
        ((x, router, gu, down[:, :, :8], 2), "w_down must be"),
        ((x, router, gu, down, 5), "top_k 5"),
        ((x, router, gu, down, 0), "top_k 0"),
        ((x.unsqueeze(0), router, gu, down, 2), "x must be 2-D"),
        ((x, router, gu.transpose(1, 2).contiguous().transpose(1, 2), down, 2), "w_gate_up must have unit stride"),
        ((x, router, torch.cat([gu, gu])[::2], down, 2), "w_gate_up must be contiguous"),
    ]
    for args, msg in cases:
        with pytest.raises(KernelInputError, match=msg):
            fused_moe(*args, renormalize=False)
    assert fused_moe(x[:0], router, gu, down, 2, False).shape == (0, 32)


def test_rows_over_slots_in_passes_equal_the_fused_moe_bit_for_bit(gen, device):
    """An offloaded layer: the experts a step routes to sit in device slots (a permutation, fewer
    slots than experts) and are computed in passes of what fits; the rows, summed, are fused_moe's."""
    from residency.kernels.moe import fused_moe_rows

    T, H, inter, E, top_k = 9, 64, 48, 12, 3
    x, router, gu, down = make_moe(gen, device, T=T, H=H, inter=inter, E=E)
    want = fused_moe(x, router, gu, down, top_k, False)
    weights, experts = route(x, router, top_k, False)
    hit = sorted(set(experts.reshape(-1).tolist()))
    S = 4                                                  # device slots: fewer than the experts hit
    slots_gu = torch.full((S, 2 * inter, H), float("nan"), device=device)
    slots_dn = torch.full((S, H, inter), float("nan"), device=device)
    rows = torch.full((T * top_k, H), float("nan"), device=device)
    for i in range(0, len(hit), S):
        chunk = hit[i:i + S]
        order = torch.randperm(S, generator=gen)[:len(chunk)].tolist()     # any slot may hold any expert
        lut = torch.full((E,), S, dtype=torch.int64)
        for e, s in zip(chunk, order):
            slots_gu[s], slots_dn[s] = gu[e], down[e]
            lut[e] = s
        fused_moe_rows(x, weights, lut.to(device)[experts], slots_gu, slots_dn, rows, skip_id=S)
    assert not rows.isnan().any()
    assert use_triton(device)           # the kernel itself (compiled, or the interpreter on CPU)
    assert torch.equal(rows.view(T, top_k, H).sum(dim=1), want)


def test_reference_accumulated_in_ascending_passes_equals_the_reference_bit_for_bit(gen):
    from residency.kernels.moe import accumulate_experts_ref

    T, H, inter, E, top_k = 13, 32, 24, 10, 4
    x, router, gu, down = make_moe(gen, "cpu", T=T, H=H, inter=inter, E=E)
    want = fused_moe_ref(x, router, gu, down, top_k, True)
    weights, experts = route(x, router, top_k, True)
    hit = sorted(set(experts.reshape(-1).tolist()))
    out = torch.zeros_like(x)
    slot_of = {e: (7 * e) % E for e in hit}                 # stacks permuted: the index is what is read
    perm_gu, perm_dn = torch.empty_like(gu), torch.empty_like(down)
    for e, s in slot_of.items():
        perm_gu[s], perm_dn[s] = gu[e], down[e]
    for i in range(0, len(hit), 3):
        accumulate_experts_ref(x, weights, experts, perm_gu, perm_dn, out, hit[i:i + 3], slot_of.__getitem__)
    assert torch.equal(out, want)
