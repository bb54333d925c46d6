"""Scatter rows of a table into chosen blocks of a pool, in one launch (the reverse of gather).

    dst[dst_slots[i], :] = src[src_rows[i], :]      for i in 0..n-1   (src_rows defaults to i)

``dst`` is usually the device KV pool seen as int32 words; ``src`` is a device staging buffer or
the pinned host pool itself (a kernel on the GPU reads mapped pinned pages over PCIe, so a
restore needs no staging copy).

Why it is fast: as for gather, every block is one contiguous row, so each program streams
64 KiB of unit-stride reads and writes with 16-byte vectors; bytes moved = 2 × n × row_bytes,
at the speed of the slower side (PCIe ~55 GB/s when ``src`` is pinned host memory).
``dst_slots`` must not repeat: two programs writing one row would race, so the wrapper refuses it.
"""
from collections.abc import Sequence

import torch

from residency.kernels._common import (
    KernelInputError,
    check_pair,
    check_rows,
    dual_mode_kernel,
    kernel_device,
    prepare_index,
    row_tiling,
    tl,
    triton,
    use_triton,
)


def _scatter_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr,
    row_words, src_stride, dst_stride,
    HAS_SRC_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)            # which block of the move
    c = tl.program_id(1)            # which CHUNK of that block
    d = tl.load(dst_idx_ptr + i).to(tl.int64)
    if HAS_SRC_IDX:
        s = tl.load(src_idx_ptr + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    src_row = src_ptr + s * src_stride
    dst_row = dst_ptr + d * dst_stride
    for k in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + k + tl.arange(0, BLOCK)
        mask = offs < row_words
        v = tl.load(src_row + offs, mask=mask)
        tl.store(dst_row + offs, v, mask=mask)


_scatter = dual_mode_kernel(_scatter_kernel)


def scatter_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor | Sequence[int],
    src_rows: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Copy rows ``src[src_rows[i]]`` (or ``src[i]``) to ``dst[dst_slots[i]]``; returns ``dst``.

    Refuses (``KernelInputError``, naming the argument): non-2-D tables, unsupported dtypes,
    non-unit row stride, mismatched dtype/row length, pageable host memory paired with a GPU
    table, overlapping src/dst, out-of-range or duplicate ``dst_slots``.
    Runs asynchronously on the current CUDA stream when a table is on the GPU.
    """
    op = "scatter_blocks"
    check_rows(op, "src", src)
    check_rows(op, "dst", dst)
    check_pair(op, src, dst)
    dev = kernel_device(src, dst)
    didx = prepare_index(op, "dst_slots", dst_slots, dst.shape[0], dev, unique=True)
    n = didx.numel()
    if src_rows is None:
        if n > src.shape[0]:
            raise KernelInputError(f"{op}: {n} dst_slots but src has only {src.shape[0]} rows")
        sidx = None
    else:
        sidx = prepare_index(op, "src_rows", src_rows, src.shape[0], dev, unique=False)
        if sidx.numel() != n:
            raise KernelInputError(f"{op}: {n} dst_slots but {sidx.numel()} src_rows")
    if n == 0 or dst.shape[1] == 0:
        return dst
    if not use_triton(dev):
        return scatter_blocks_ref(src, dst, didx, sidx)
    block, chunk, chunks = row_tiling(dst.shape[1])
    _scatter[(n, chunks)](
        src, dst, sidx if sidx is not None else didx, didx,
        dst.shape[1], src.stride(0), dst.stride(0),
        HAS_SRC_IDX=sidx is not None, CHUNK=chunk, BLOCK=block,
    )
    return dst


def scatter_blocks_trusted(src: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor) -> torch.Tensor:
    """``scatter_blocks(src, dst, dst_slots)`` without its checks (see ``gather_blocks_trusted``):
    for the engine's own staging buffers, pools and slot indices. Non-CUDA calls are checked."""
    if not (src.is_cuda or dst.is_cuda) or triton is None:
        return scatter_blocks(src, dst, dst_slots)
    n = dst_slots.numel()
    if n == 0 or dst.shape[1] == 0:
        return dst
    block, chunk, chunks = row_tiling(dst.shape[1])
    _scatter[(n, chunks)](src, dst, dst_slots, dst_slots, dst.shape[1], src.stride(0), dst.stride(0),
                          HAS_SRC_IDX=False, CHUNK=chunk, BLOCK=block)
    return dst


def scatter_blocks_ref(
    src: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor, src_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: index_select (or a prefix) then index_copy_."""
    dst_slots = torch.as_tensor(dst_slots, dtype=torch.int64).to(dst.device)
    if src_rows is None:
        rows = src[: dst_slots.numel()]
    else:
        rows = src.index_select(0, torch.as_tensor(src_rows, dtype=torch.int64).to(src.device))
    dst.index_copy_(0, dst_slots, rows.to(dst.device))
    return dst
