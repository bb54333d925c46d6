"""Per-block checksums: psum64, a position-salted sum of SplitMix64-mixed words.

For a block with logical id ``b`` whose bytes are the int32 words w_0 .. w_{W-1}:

    mix64(z)  = SplitMix64's finalizer: z ^= z>>30; z *= 0xBF58476D1CE4E5B9;
                                        z ^= z>>27; z *= 0x94D049BB133111EB; z ^= z>>31
    seed(b)   = mix64(b ^ 0x9E3779B97F4A7C15)
    term_i    = mix64(((i << 32) | uint32(w_i)) + seed(b))            (all arithmetic mod 2^64)
    psum64(b) = mix64(Σ_i term_i  +  W)

What it catches, and why:
  * any change confined to one word, in particular ONE FLIPPED BIT, always: for fixed i and b,
    w ↦ term_i is injective (OR-ing a 32-bit word under a distinct high half, adding a constant
    and mix64 are all injective), so exactly one term changes, the sum mod 2^64 changes, and the
    final mix64 is a bijection. This is a guarantee, not a probability.
  * TWO SWAPPED BLOCKS: the checksum of a block is computed under its own logical id, so block
    b's slot holding block c's bytes (or a file of c named b) hashes to an unrelated 64-bit value
    (a miss is a ~2^-64 coincidence); the same holds for pages swapped or shifted inside a block,
    because every word is salted with its position.
  * truncation or extension: W is folded in.
It is not cryptographic: it guards against faults (bad DMA, torn writes, bit rot, mixed-up
slots), not against someone forging data.

Speed: the sum is order-free, so the kernel splits every block into 64 KiB chunks (one program
each; a 2 MiB block is 32 programs), sums each chunk's terms in registers, stores one partial
per chunk, and a second tiny kernel folds the partials. Bytes read = n × block_bytes, once; the
arithmetic (two 64-bit multiplies per 4 bytes) stays under the cost of reading the bytes from HBM,
so a restore's check costs a few percent of what the same bytes take to cross PCIe (HBM is ~50x
faster than the link).
"""
import functools
from collections.abc import Sequence

import torch

from residency.kernels._common import (
    SUM_COMBINE,
    KernelInputError,
    check_rows,
    dual_mode_kernel,
    kernel_device,
    next_pow2,
    prepare_index,
    row_tiling,
    tl,
    use_triton,
)

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _checksum_partial_kernel(
    words_ptr, slot_ptr, id_ptr, partial_ptr,
    row_words, row_stride, num_chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)            # which block
    c = tl.program_id(1)            # which CHUNK of it
    slot = tl.load(slot_ptr + i).to(tl.int64)
    seed = tl.load(id_ptr + i).to(tl.uint64) ^ 0x9E3779B97F4A7C15
    seed = (seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9
    seed = (seed ^ (seed >> 27)) * 0x94D049BB133111EB
    seed = seed ^ (seed >> 31)
    row = words_ptr + slot * row_stride
    acc = tl.full([BLOCK], 0, dtype=tl.uint64)
    for k in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + k + tl.arange(0, BLOCK)
        mask = offs < row_words
        w = tl.load(row + offs, mask=mask, other=0)
        z = (offs.to(tl.uint64) << 32) | w.to(tl.uint32, bitcast=True).to(tl.uint64)
        z = z + seed
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        acc += tl.where(mask, z, 0)
    tl.store(partial_ptr + i * num_chunks + c, tl.reduce(acc, 0, SUM_COMBINE))


def _checksum_fold_kernel(partial_ptr, out_ptr, row_words, num_chunks, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    p = tl.load(partial_ptr + i * num_chunks + offs, mask=offs < num_chunks, other=0)
    z = tl.reduce(p, 0, SUM_COMBINE) + row_words
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    tl.store(out_ptr + i, z)


_partial = dual_mode_kernel(_checksum_partial_kernel)
_fold = dual_mode_kernel(_checksum_fold_kernel)


def block_checksums(
    words: torch.Tensor,
    slots: torch.Tensor | Sequence[int],
    block_ids: torch.Tensor | Sequence[int],
) -> torch.Tensor:
    """psum64 of rows ``words[slots[i]]`` salted with ``block_ids[i]``: uint64 ``[n]``.

    ``words`` must be int32 ``[rows, row_words]`` with unit row stride (view a pool with
    ``.view(rows, -1).view(torch.int32)``); other dtypes are refused by name, because the
    function is defined over int32 words. ``block_ids`` are logical ids in [0, 2^63).
    Runs on words' device; for pinned host ``words`` with ``slots`` on a GPU, on that GPU.
    Asynchronous on the current CUDA stream; ``checksums_to_ints`` brings the values home.
    """
    op = "block_checksums"
    check_rows(op, "words", words, dtypes=(torch.int32,))
    # The kernel runs where the table is, or on the GPU that holds the slot index when the
    # table is pinned host memory (the kernel then reads the mapped pages over PCIe).
    dev = kernel_device(words, *(t for t in (slots, block_ids) if isinstance(t, torch.Tensor)))
    if dev.type == "cuda" and not words.is_cuda and not words.is_pinned():
        raise KernelInputError(f"{op}: words is pageable host memory; a kernel on {dev} reads host "
                               f"memory only through pinned (page-locked, mapped) pages")
    sidx = prepare_index(op, "slots", slots, words.shape[0], dev, unique=False)
    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.as_tensor(list(block_ids), dtype=torch.int64)
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise KernelInputError(f"{op}: block_ids must be 1-D int32/int64, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() != sidx.numel():
        raise KernelInputError(f"{op}: {sidx.numel()} slots but {ids.numel()} block_ids")
    if not ids.is_cuda and ids.numel() and int(ids.min()) < 0:
        raise KernelInputError(f"{op}: block_ids must be >= 0, got {int(ids.min())}")
    ids = ids.to(torch.int64).to(dev).contiguous()
    n = sidx.numel()
    out = torch.empty(n, dtype=torch.uint64, device=dev)
    if n == 0:
        return out
    if not use_triton(dev):
        return block_checksums_ref(words, sidx, ids)
    row_words = words.shape[1]
    block, chunk, chunks = row_tiling(max(row_words, 1))
    partial = torch.empty((n, chunks), dtype=torch.uint64, device=dev)
    _partial[(n, chunks)](
        words, sidx, ids, partial, row_words, words.stride(0), chunks, CHUNK=chunk, BLOCK=block,
    )
    _fold[(n,)](partial, out, row_words, chunks, BLOCK_C=next_pow2(chunks))
    return out


def checksums_to_ints(sums: torch.Tensor) -> list[int]:
    """uint64 checksums as Python ints in [0, 2^64) (synchronizes if they are on the GPU)."""
    return [int(v) for v in sums.cpu().tolist()]


# ---------------------------------------------------------------- reference
_M1_S = _M1 - (1 << 64)  # the multipliers as int64 bit patterns (torch has no uint64 multiply)
_M2_S = _M2 - (1 << 64)


# The reference hashes this many bytes of int64 words at a time (many blocks of a small layout,
# a few rows of a big one): few torch calls per block for the CPU path, whose moves checksum with
# it, while its temporaries still fit in cache. One row at a time made per-call overhead dominate
# for small blocks; larger batches bought nothing (bench/RESULTS.md has the timings).
_REF_BATCH_BYTES = 2 << 20


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 bit patterns, in place (``tmp``: scratch of z's shape).
    Multiplications wrap mod 2^64; the shifts are logical (torch's >> on int64 is arithmetic,
    so the sign bits it brings in are masked off)."""
    for shift, mul in ((30, _M1_S), (27, _M2_S), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)
    return z


@functools.lru_cache(maxsize=8)
def _positions_high(row_words: int) -> torch.Tensor:
    """Each word's position in the high half (i << 32), for rows of ``row_words``; read-only (one
    per layout a worker moves, kept: building it took ~0.2 ms of a 6-block CPU move's ~4)."""
    return torch.arange(row_words, dtype=torch.int64) << 32


def block_checksums_ref(words: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The torch reference on int64 bit patterns (multiplication and sums wrap mod 2^64).

    Rows are hashed in batches of about ``_REF_BATCH_BYTES`` of int64 words (at least one row),
    in place, so memory stays at two temporaries of one batch.
    """
    slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
    ids = torch.as_tensor(block_ids, dtype=torch.int64).cpu()
    n, row_words = slots.numel(), words.shape[1]
    pos_hi = _positions_high(row_words)
    seeds = ids ^ (_GOLDEN - (1 << 64))
    _mix64_(seeds, torch.empty_like(seeds))
    out = torch.empty(n, dtype=torch.int64)
    batch = max(1, _REF_BATCH_BYTES // max(1, 8 * row_words))
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        z = words.index_select(0, slots[lo:hi].to(words.device)).cpu().to(torch.int64)
        z.bitwise_and_(0xFFFFFFFF).bitwise_or_(pos_hi).add_(seeds[lo:hi, None])
        _mix64_(z, torch.empty_like(z))
        torch.sum(z, 1, out=out[lo:hi])
    out.add_(row_words)
    _mix64_(out, torch.empty_like(out))
    return out.view(torch.uint64).to(words.device)


def block_checksum_py(words: Sequence[int], block_id: int) -> int:
    """The definition in plain Python integers, for pinning the references on tiny blocks."""

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * _M1) & _MASK64
        z = ((z ^ (z >> 27)) * _M2) & _MASK64
        return z ^ (z >> 31)

    seed = mix((block_id ^ _GOLDEN) & _MASK64)
    total = 0
    for i, w in enumerate(words):
        total = (total + mix((((i << 32) | (w & 0xFFFFFFFF)) + seed) & _MASK64)) & _MASK64
    return mix((total + len(words)) & _MASK64)
