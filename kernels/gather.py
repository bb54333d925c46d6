"""Gather scattered blocks of a pool into rows of another table, in one launch.

    out[out_rows[i], :] = src[src_slots[i], :]      for i in 0..n-1   (out_rows defaults to i)

``src`` is usually the device KV pool seen as int32 words ``[num_blocks, block_words]``; ``out``
is a device staging buffer, or the pinned host pool itself: a kernel on the GPU can store straight
into pinned (mapped) host memory, so a spill needs no staging copy at all.

Why it is fast: a KV block is one contiguous row (the pool is block-first), so every program
reads and writes long unit-stride runs: 64 KiB per program, 4 KiB per iteration, 16-byte vector
loads and stores. Bytes moved = 2 × n × row_bytes (read once, write once); nothing else is
touched, so the kernel runs at the speed of the slower side: HBM (~4 TB/s read+write) for
device staging, the PCIe link when ``out`` is pinned host memory.
One launch replaces the n (or n × layers × 2) cudaMemcpyAsync calls of a per-block copy loop.
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


def _gather_kernel(
    src_ptr, out_ptr, src_idx_ptr, out_idx_ptr,
    row_words, src_stride, out_stride,
    HAS_OUT_IDX: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)            # which block of the move
    c = tl.program_id(1)            # which CHUNK of that block
    s = tl.load(src_idx_ptr + i).to(tl.int64)
    if HAS_OUT_IDX:
        d = tl.load(out_idx_ptr + i).to(tl.int64)
    else:
        d = i.to(tl.int64)
    src_row = src_ptr + s * src_stride
    out_row = out_ptr + d * out_stride
    for k in range(0, CHUNK, BLOCK):
        offs = c * CHUNK + k + tl.arange(0, BLOCK)
        mask = offs < row_words
        v = tl.load(src_row + offs, mask=mask)
        tl.store(out_row + offs, v, mask=mask)


_gather = dual_mode_kernel(_gather_kernel)


def gather_blocks(
    src: torch.Tensor,
    src_slots: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    out_rows: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Copy rows ``src[src_slots[i]]`` to ``out[out_rows[i]]`` (or ``out[i]``); returns ``out``.

    Refuses (``KernelInputError``, naming the argument): non-2-D tables, unsupported dtypes,
    non-unit row stride, mismatched dtype/row length, pageable host memory paired with a GPU
    table, overlapping src/out, out-of-range or (for ``out_rows``) duplicate indices.
    Runs asynchronously on the current CUDA stream when a table is on the GPU.
    """
    op = "gather_blocks"
    check_rows(op, "src", src)
    check_rows(op, "out", out)
    check_pair(op, src, out)
    dev = kernel_device(src, out)
    sidx = prepare_index(op, "src_slots", src_slots, src.shape[0], dev, unique=False)
    n = sidx.numel()
    if out_rows is None:
        if n > out.shape[0]:
            raise KernelInputError(f"{op}: {n} blocks do not fit in out's {out.shape[0]} rows")
        oidx = None
    else:
        oidx = prepare_index(op, "out_rows", out_rows, out.shape[0], dev, unique=True)
        if oidx.numel() != n:
            raise KernelInputError(f"{op}: {n} src_slots but {oidx.numel()} out_rows")
    if n == 0 or src.shape[1] == 0:
        return out
    if not use_triton(dev):
        return gather_blocks_ref(src, sidx, out, oidx)
    block, chunk, chunks = row_tiling(src.shape[1])
    _gather[(n, chunks)](
        src, out, sidx, oidx if oidx is not None else sidx,
        src.shape[1], src.stride(0), out.stride(0),
        HAS_OUT_IDX=oidx is not None, CHUNK=chunk, BLOCK=block,
    )
    return out


def gather_blocks_trusted(src: torch.Tensor, src_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``gather_blocks(src, src_slots, out)`` without its checks, for callers that built every
    argument themselves and checked their tables once (the engine: its pools and staging buffers
    never change shape; its slot indices come from its own tables). ~30 µs less host time per
    launch, which is per chunk of a move. ``src_slots``: int64 on the kernel's device. Anything
    but CUDA goes through the checked ``gather_blocks``."""
    if not (src.is_cuda or out.is_cuda) or triton is None:
        return gather_blocks(src, src_slots, out)
    n = src_slots.numel()
    if n == 0 or src.shape[1] == 0:
        return out
    block, chunk, chunks = row_tiling(src.shape[1])
    _gather[(n, chunks)](src, out, src_slots, src_slots, src.shape[1], src.stride(0), out.stride(0),
                         HAS_OUT_IDX=False, CHUNK=chunk, BLOCK=block)
    return out


def gather_blocks_ref(
    src: torch.Tensor, src_slots: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: index_select then index_copy_ (two passes, a temporary of n rows)."""
    src_slots = torch.as_tensor(src_slots, dtype=torch.int64).to(src.device)
    rows = src.index_select(0, src_slots).to(out.device)
    if out_rows is None:
        out[: rows.shape[0]].copy_(rows)
    else:
        out.index_copy_(0, torch.as_tensor(out_rows, dtype=torch.int64).to(out.device), rows)
    return out

