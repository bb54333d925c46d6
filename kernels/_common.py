"""What every block kernel shares: input checks that refuse by name, index preparation, launch.

The block kernels (gather, scatter, checksum) all see a pool as a 2-D table of rows:

    rows ─► ┌──────────── row_words (stride(1) == 1) ────────────┐
    slot 0  │ w0 w1 w2 ...                                       │  ◄─ stride(0) elements apart
    slot 1  │ ...                                                │
            └────────────────────────────────────────────────────┘

A KV block is one row (the device pool is block-first, so a block is one contiguous span).

Where a kernel runs is decided per call, from the tensors it is given:
  * CUDA tensors                       -> the compiled Triton kernel;
  * CPU tensors and TRITON_INTERPRET=1 -> the same kernel through Triton's interpreter (tests);
  * CPU tensors otherwise              -> the torch ``*_ref`` (CPU-only workers, the default).
The decision is taken at call time, not at import, so a process may import the kernels before
a test sets TRITON_INTERPRET; each mode gets its own kernel object (``DualModeKernel``).
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from collections.abc import Sequence
from typing import Any, Callable

import torch

from residency.kernels.cache import install_shared_cache

try:  # Triton is optional on CPU-only hosts: without it the torch references run.
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - every environment we ship has triton
    triton = None
    tl = SimpleNamespace(constexpr=object)  # lets kernel signatures be defined; never launched
    InterpretedFunction = JITFunction = None


class KernelInputError(ValueError):
    """An argument a kernel wrapper refuses; the message names the argument and what is wrong."""


# Dtypes the copy kernels move. They move bits, so any 1/2/4/8-byte numeric type would work;
# the list is explicit so a caller passing bool/complex/float64 hears about it by name.
COPY_DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32,
)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_triton(device: torch.device) -> bool:
    """Whether a kernel on ``device`` runs through Triton (compiled or interpreted) or its ``_ref``."""
    if triton is None:
        return False
    return device.type == "cuda" or interpret_requested()


class DualModeKernel:
    """A Triton kernel body that can be launched compiled (CUDA) or interpreted (CPU tensors).

    ``triton.jit`` picks the interpreter at decoration time from TRITON_INTERPRET; we keep the
    undecorated function and build each flavour on first use instead.
    NOTE: kernel bodies wrapped this way must not call ``@triton.jit`` functions, ours or the
    library's (``tl.zeros``, ``tl.sum``, ``tl.cdiv`` are JIT functions built at import time and
    fail inside an interpreter switched on later): mixing is written inline, accumulators start
    from ``tl.full`` and reductions use ``tl.reduce(x, axis, SUM_COMBINE)``.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled = None
        self._interpreted = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            return self._flavour(cuda)[grid](*args, **kwargs)

        return launch

    def _flavour(self, cuda: bool):
        if cuda:
            if self._compiled is None:
                # Before the first compile in this process: the ranks of a host compile into one
                # cache, a key at a time (kernels/cache.py).
                install_shared_cache()
                self._compiled = JITFunction(self.fn)
            return self._compiled
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted


def dual_mode_kernel(fn: Callable[..., Any]) -> DualModeKernel:
    return DualModeKernel(fn)


# The combine function of reductions inside dual-mode kernels. The library's ``tl.sum`` is a JIT
# function built at import time and fails inside an interpreter switched on later, but
# ``tl.reduce(x, axis, SUM_COMBINE)`` works in both flavours: compiled, it is an ordinary
# combine function (integer adds wrap); interpreted, Triton recognises it and calls np.sum.
SUM_COMBINE = triton.language.standard._sum_combine if triton is not None else None


# ---------------------------------------------------------------- checks
def check_rows(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = COPY_DTYPES) -> None:
    """A row table: 2-D, supported dtype, unit stride along a row, rows not overlapping."""
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise KernelInputError(f"{op}: {name} must be 2-D [rows, row_words], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelInputError(f"{op}: {name} dtype {t.dtype} is not supported (supported: {names})")
    if t.shape[1] > 0 and t.stride(1) != 1:
        raise KernelInputError(
            f"{op}: {name} must have unit stride along a row, got strides {tuple(t.stride())}"
        )
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise KernelInputError(
            f"{op}: {name} rows overlap (stride(0)={t.stride(0)} < row_words={t.shape[1]})"
        )


def check_pair(op: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Source and destination tables: same dtype and row length; devices a kernel can reach."""
    if src.dtype != dst.dtype:
        raise KernelInputError(f"{op}: dtype mismatch, src {src.dtype} vs dst {dst.dtype}")
    if src.shape[1] != dst.shape[1]:
        raise KernelInputError(f"{op}: row_words mismatch, src {src.shape[1]} vs dst {dst.shape[1]}")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise KernelInputError(f"{op}: src on {src.device} and dst on {dst.device}; one device only")
    for a, b, an, bn in ((src, dst, "src", "dst"), (dst, src, "dst", "src")):
        if a.is_cuda and not b.is_cuda and not b.is_pinned():
            raise KernelInputError(
                f"{op}: {bn} is pageable host memory; a kernel on {a.device} reaches host memory "
                f"only through pinned (page-locked, mapped) pages"
            )
    if dst.shape[1] > 0 and _overlaps(src, dst):
        raise KernelInputError(f"{op}: src and dst share memory; copies between overlapping tables are refused")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    ea = a.element_size()
    a0 = a.data_ptr()
    a1 = a0 + ((a.shape[0] - 1) * a.stride(0) + a.shape[1]) * ea
    b0 = b.data_ptr()
    b1 = b0 + ((b.shape[0] - 1) * b.stride(0) + b.shape[1]) * ea
    return a0 < b1 and b0 < a1


def prepare_index(
    op: str, name: str, idx: torch.Tensor | Sequence[int], num_rows: int, device: torch.device,
    unique: bool,
) -> torch.Tensor:
    """An index vector as int64 on ``device``; bounds (and uniqueness) checked on the host.

    An index already on a CUDA device is trusted for bounds: checking it would cost a device
    sync on the copy path. The engine always passes host-side indices.
    """
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(list(idx), dtype=torch.int64)
    if idx.dtype not in INDEX_DTYPES:
        raise KernelInputError(f"{op}: {name} dtype {idx.dtype} is not supported (int32 or int64)")
    if idx.dim() != 1:
        raise KernelInputError(f"{op}: {name} must be 1-D, got shape {tuple(idx.shape)}")
    if not idx.is_cuda and idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_rows:
            bad = idx[(idx < 0) | (idx >= num_rows)][:8].tolist()
            raise KernelInputError(f"{op}: {name} out of range [0, {num_rows}): {bad}")
        if unique and torch.unique(idx).numel() != idx.numel():
            vals, counts = torch.unique(idx, return_counts=True)
            raise KernelInputError(f"{op}: {name} has duplicates: {vals[counts > 1][:8].tolist()}")
    idx = idx.to(torch.int64)
    if idx.device != device:
        idx = idx.to(device, non_blocking=False)
    return idx.contiguous()


def kernel_device(*tensors: torch.Tensor) -> torch.device:
    """The device the kernel runs on: the CUDA one if any tensor is on CUDA, else CPU."""
    for t in tensors:
        if t.is_cuda:
            return t.device
    return torch.device("cpu")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_tiling(row_words: int, block: int = 1024, chunk: int = 16384) -> tuple[int, int, int]:
    """(BLOCK, CHUNK, chunks_per_row): each program handles CHUNK words of one row, BLOCK at a time.

    CHUNK = 16384 int32 words = 64 KiB per program: a 2 MiB KV block becomes 32 programs, so
    even a one-block move spreads over 32 SMs, and a 1024-block move over ~33k programs.
    """
    block = min(block, next_pow2(max(row_words, 1)))
    chunk = max(block, min(chunk, next_pow2(max(row_words, 1))))
    chunk = (chunk // block) * block
    return block, chunk, max(1, -(-row_words // chunk))
