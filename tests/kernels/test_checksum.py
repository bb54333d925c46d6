"""psum64: the Triton kernel equals the torch reference equals the definition, and it catches
one flipped bit, swapped blocks, swapped pages and truncation."""
import pytest
import torch

import residency.kernels.checksum as ck
from residency.kernels._common import KernelInputError
from residency.kernels.checksum import block_checksum_py, block_checksums, block_checksums_ref, checksums_to_ints
from tests.kernels.helpers_kernels import random_table


def sums(words, slots, ids):
    return checksums_to_ints(block_checksums(words, torch.as_tensor(slots), torch.as_tensor(ids)))


@pytest.mark.parametrize("rows,words", [(3, 1), (4, 7), (5, 333), (2, 4099)])
@pytest.mark.parametrize("batch_rows", [None, 1, 2])       # the reference's batches: as shipped, one row, two
def test_reference_equals_the_definition_in_plain_integers(rows, words, batch_rows, gen, monkeypatch):
    if batch_rows is not None:
        monkeypatch.setattr(ck, "_REF_BATCH_BYTES", 8 * words * batch_rows)
    t = random_table(rows, words, torch.int32, gen, "cpu")
    ids = torch.randint(0, 1 << 62, (rows,), generator=gen)
    slots = torch.randperm(rows, generator=gen)
    ref = checksums_to_ints(block_checksums_ref(t, slots, ids))
    assert ref == [block_checksum_py(t[int(s)].tolist(), int(ids[i])) for i, s in enumerate(slots)]


@pytest.mark.parametrize("rows,words,n", [(5, 1, 3), (6, 37, 6), (4, 1000, 2), (3, 16384 * 2 + 5, 2)])
def test_kernel_equals_reference_on_irregular_shapes(rows, words, n, device, gen, monkeypatch):
    t = random_table(rows, words, torch.int32, gen, device)
    slots = torch.randperm(rows, generator=gen)[:n]
    ids = torch.randint(0, 1 << 62, (n,), generator=gen)
    want = checksums_to_ints(block_checksums_ref(t.cpu(), slots, ids))
    monkeypatch.setattr(ck, "block_checksums_ref", _must_not_run)
    assert sums(t, slots, ids) == want


def test_kernel_handles_strided_tables(device, gen):
    wide = random_table(4, 500, torch.int32, gen, device)
    view = wide[:, 3:3 + 401]
    assert sums(view, [2, 0], [9, 10]) == sums(view.contiguous(), [2, 0], [9, 10])


def test_one_flipped_bit_anywhere_is_always_caught(device, gen):
    t = random_table(4, 777, torch.int32, gen, device)
    ids = [11, 12, 13, 14]
    base = sums(t, range(4), ids)
    for _ in range(40):
        r = int(torch.randint(0, 4, (1,), generator=gen))
        w = int(torch.randint(0, 777, (1,), generator=gen))
        bit = int(torch.randint(0, 32, (1,), generator=gen))
        flipped = t.clone()
        flipped[r, w] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
        got = sums(flipped, range(4), ids)
        assert got[r] != base[r], f"bit {bit} of word {w} in row {r} went unnoticed"
        assert [g for i, g in enumerate(got) if i != r] == [b for i, b in enumerate(base) if i != r]


def test_two_swapped_blocks_are_caught(device, gen):
    t = random_table(5, 640, torch.int32, gen, device)
    ids = [100, 101, 102, 103, 104]
    base = sums(t, range(5), ids)
    swapped = t.clone()
    swapped[[1, 3]] = t[[3, 1]]
    got = sums(swapped, range(5), ids)
    assert got[1] != base[1] and got[3] != base[3]
    assert (got[0], got[2], got[4]) == (base[0], base[2], base[4])


def test_swapped_pages_inside_a_block_are_caught(device, gen):
    t = random_table(2, 64 * 6, torch.int32, gen, device)
    pages = t.clone().view(2, 6, 64)
    pages[0, [1, 4]] = pages[0, [4, 1]]
    assert sums(pages.view(2, -1), [0], [7]) != sums(t, [0], [7])


def test_same_bytes_under_another_id_hash_differently(device, gen):
    t = random_table(1, 100, torch.int32, gen, device)
    assert sums(t, [0], [5]) != sums(t, [0], [6])


def test_a_truncated_block_hashes_differently(device, gen):
    t = random_table(1, 100, torch.int32, gen, device)
    assert sums(t[:, :99], [0], [5]) != sums(t, [0], [5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_the_gpu_hashes_pinned_host_rows_in_place(gen):
    from residency.dataplane.pools import PinnedBudget

    buf = PinnedBudget(1 << 22, pin=True).alloc("test", (3, 4099), torch.int32)
    try:
        buf.tensor.copy_(random_table(3, 4099, torch.int32, gen, "cpu"))
        on_gpu = checksums_to_ints(block_checksums(buf.tensor, torch.tensor([2, 0]).cuda(), torch.tensor([4, 5]).cuda()))
        assert on_gpu == checksums_to_ints(block_checksums_ref(buf.tensor, torch.tensor([2, 0]), torch.tensor([4, 5])))
    finally:
        buf.close()


def test_checksum_refuses_unsupported_input_by_name(device):
    with pytest.raises(KernelInputError, match="bfloat16 is not supported"):
        block_checksums(torch.ones(2, 8, dtype=torch.bfloat16, device=device), [0], [1])
    with pytest.raises(KernelInputError, match="2 slots but 1 block_ids"):
        block_checksums(torch.ones(2, 8, dtype=torch.int32, device=device), [0, 1], [1])
    with pytest.raises(KernelInputError, match="block_ids must be >= 0"):
        block_checksums(torch.ones(2, 8, dtype=torch.int32, device=device), [0], [-3])
    with pytest.raises(KernelInputError, match="out of range"):
        block_checksums(torch.ones(2, 8, dtype=torch.int32, device=device), [2], [1])
    with pytest.raises(KernelInputError, match="unit stride"):
        block_checksums(torch.ones(8, 2, dtype=torch.int32, device=device).t(), [0], [1])


def _must_not_run(*a, **k):
    raise AssertionError("the torch reference ran where the Triton kernel should have")
