"""gather_blocks / scatter_blocks against their torch references, on irregular shapes."""
import pytest
import torch
from tests.kernels.helpers_kernels import is_poison, poisoned, random_table

import residency.kernels.gather as gather_mod
import residency.kernels.scatter as scatter_mod
from residency.kernels._common import KernelInputError, use_triton
from residency.kernels.gather import gather_blocks, gather_blocks_ref
from residency.kernels.scatter import scatter_blocks, scatter_blocks_ref

# (rows in the pool, row_words, blocks moved): odd sizes, a single word, a row spanning 2+ chunks.
SHAPES = [(5, 1, 3), (9, 37, 4), (7, 1000, 7), (6, 4099, 2), (4, 16385 + 3, 3)]
DTYPES = [torch.int32, torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int64]


def _pick(n_from: int, n: int, gen) -> torch.Tensor:
    return torch.randperm(n_from, generator=gen)[:n]


def test_the_kernels_run_through_triton_here(device):
    """Guard: these tests must exercise the Triton kernel, not fall back to the reference."""
    assert use_triton(device)


@pytest.mark.parametrize("rows,words,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_reference_and_writes_only_its_rows(rows, words, n, dtype, device, gen, monkeypatch):
    src = random_table(rows, words, dtype, gen, device)
    slots = _pick(rows, n, gen)
    out_rows = _pick(n + 2, n, gen)
    out = poisoned(n + 2, words, dtype, device)
    want = poisoned(n + 2, words, dtype, device)
    gather_blocks_ref(src, slots, want, out_rows)
    monkeypatch.setattr(gather_mod, "gather_blocks_ref", _must_not_run)
    gather_blocks(src, slots, out, out_rows)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # bitwise: NaN poison compares
    untouched = torch.ones(n + 2, dtype=torch.bool)
    untouched[out_rows] = False
    assert is_poison(out.cpu())[untouched].all()


@pytest.mark.parametrize("rows,words,n", SHAPES)
def test_gather_without_out_rows_fills_a_prefix(rows, words, n, device, gen):
    src = random_table(rows, words, torch.int32, gen, device)
    slots = _pick(rows, n, gen)
    out = poisoned(n + 1, words, torch.int32, device)
    gather_blocks(src, slots, out)
    assert torch.equal(out[:n], src[slots.to(device)])
    assert is_poison(out[n:].cpu()).all()


@pytest.mark.parametrize("rows,words,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.uint8])
def test_scatter_matches_reference_and_writes_only_its_slots(rows, words, n, dtype, device, gen, monkeypatch):
    src = random_table(n + 1, words, dtype, gen, device)
    src_rows = _pick(n + 1, n, gen)
    slots = _pick(rows, n, gen)
    dst = poisoned(rows, words, dtype, device)
    want = poisoned(rows, words, dtype, device)
    scatter_blocks_ref(src, want, slots, src_rows)
    monkeypatch.setattr(scatter_mod, "scatter_blocks_ref", _must_not_run)
    scatter_blocks(src, dst, slots, src_rows)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots] = False
    assert is_poison(dst.cpu())[untouched].all()


def test_gather_then_scatter_round_trips_through_strided_tables(device, gen):
    """Row stride larger than the row (a column slice of a wider table) is honoured both ways."""
    wide = random_table(8, 300, torch.int32, gen, device)
    src = wide[:, 17:17 + 211]
    assert src.stride(0) == 300
    slots = _pick(8, 5, gen)
    staging = poisoned(5, 211, torch.int32, device)
    gather_blocks(src, slots, staging)
    back_wide = poisoned(8, 400, torch.int32, device)
    back = back_wide[:, 5:5 + 211]
    scatter_blocks(staging, back, slots)
    assert torch.equal(back[slots.to(device)], src[slots.to(device)])
    assert is_poison(back_wide[:, :5].cpu()).all() and is_poison(back_wide[:, 216:].cpu()).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_kernels_store_into_and_load_from_pinned_host_memory(gen):
    from residency.dataplane.pools import PinnedBudget

    budget = PinnedBudget(1 << 24, pin=True)
    buf = budget.alloc("test", (6, 4099), torch.int32)
    try:
        host = buf.tensor
        assert host.is_pinned()
        host.fill_(-7)
        pool = random_table(9, 4099, torch.int32, gen, "cuda")
        slots, rows = _pick(9, 4, gen), _pick(6, 4, gen)
        gather_blocks(pool, slots.cuda(), host, rows.cuda())
        torch.cuda.synchronize()
        assert torch.equal(host[rows], pool[slots.cuda()].cpu())
        back = torch.full_like(pool, -9)
        scatter_blocks(host, back, slots.cuda(), rows.cuda())
        torch.cuda.synchronize()
        assert torch.equal(back[slots.cuda()], pool[slots.cuda()])
    finally:
        buf.close()


# ---------------------------------------------------------------- refusals, by name
def _t(*shape, dtype=torch.int32, device="cpu"):
    return torch.ones(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("make,needle", [
    (lambda d: (_t(2, 3, 4, device=d), [0], _t(2, 12, device=d)), "must be 2-D"),
    (lambda d: (_t(4, 8, dtype=torch.float64, device=d), [0], _t(2, 8, dtype=torch.float64, device=d)), "float64 is not supported"),
    (lambda d: (_t(4, 8, dtype=torch.bool, device=d), [0], _t(2, 8, dtype=torch.bool, device=d)), "bool is not supported"),
    (lambda d: (_t(8, 4, device=d).t(), [0], _t(2, 8, device=d)), "unit stride"),
    (lambda d: (_t(4, 8, device=d), [0], _t(2, 8, dtype=torch.float32, device=d)), "dtype mismatch"),
    (lambda d: (_t(4, 8, device=d), [0], _t(2, 9, device=d)), "row_words mismatch"),
    (lambda d: (_t(4, 8, device=d), [4], _t(2, 8, device=d)), "out of range"),
    (lambda d: (_t(4, 8, device=d), [-1], _t(2, 8, device=d)), "out of range"),
    (lambda d: (_t(4, 8, device=d), [0, 1, 2], _t(2, 8, device=d)), "do not fit"),
    (lambda d: (_t(4, 8, device=d), torch.tensor([0.0]), _t(2, 8, device=d)), "src_slots dtype"),
])
def test_gather_refuses_unsupported_input_by_name(make, needle, device):
    src, slots, out = make(device)
    with pytest.raises(KernelInputError, match=needle):
        gather_blocks(src, slots, out)


def test_gather_refuses_duplicate_out_rows_and_overlap(device):
    src = _t(4, 8, device=device)
    with pytest.raises(KernelInputError, match="out_rows has duplicates"):
        gather_blocks(src, [0, 1], _t(3, 8, device=device), [2, 2])
    with pytest.raises(KernelInputError, match="share memory"):
        gather_blocks(src, [0], src[2:])


def test_scatter_refuses_duplicate_destination_slots(device):
    with pytest.raises(KernelInputError, match="dst_slots has duplicates"):
        scatter_blocks(_t(2, 8, device=device), _t(4, 8, device=device), [3, 3])
    with pytest.raises(KernelInputError, match="2 dst_slots but 1 src_rows"):
        scatter_blocks(_t(2, 8, device=device), _t(4, 8, device=device), [0, 1], [0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_kernel_refuses_pageable_host_memory():
    with pytest.raises(KernelInputError, match="pageable host memory"):
        gather_blocks(_t(4, 8, device="cuda"), [0], _t(2, 8))


def _must_not_run(*a, **k):
    raise AssertionError("the torch reference ran where the Triton kernel should have")


def test_trusted_launches_move_the_same_rows_as_the_checked_ones(device, gen):
    from residency.kernels.gather import gather_blocks_trusted
    from residency.kernels.scatter import scatter_blocks_trusted

    src = torch.randint(-(2**31), 2**31, (13, 777), dtype=torch.int32, generator=gen).to(device)
    idx = torch.tensor([12, 0, 5, 7], dtype=torch.int64, device=device)
    out = torch.zeros(4, 777, dtype=torch.int32, device=device)
    assert torch.equal(gather_blocks_trusted(src, idx, out), src[idx])
    dst = torch.zeros_like(src)
    scatter_blocks_trusted(out, dst, torch.tensor([3, 9, 1, 2], dtype=torch.int64, device=device))
    assert torch.equal(dst[[3, 9, 1, 2]], src[idx]) and dst[[0, 4, 5]].abs().sum() == 0
