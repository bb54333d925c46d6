"""Issuing a move's DMAs: one copy per run of slots, through the CUDA runtime or through torch.

The "dma" copy mode, the first chunk of every device<->host move and each chunk of the "staged"
mode are runs of whole rows (a run: rows consecutive on both sides) copied by one
``cudaMemcpyAsync`` each. Two ways to issue them, same bytes, same stream order:

    TorchDma  ``dst[b:b+n].copy_(src[a:a+n], non_blocking=True)`` per run: two views, the
              dispatcher, TensorIterator, torch's pinned-memory bookkeeping. The CPU path (where it
              is a plain memcpy) and the fallback.
    RawDma    ``cudaMemcpyAsync`` of the CUDA runtime torch itself loaded (found in this process's
              memory map, so it is the same runtime, context and streams), called through ctypes
              with pointers computed from the rows' base addresses. Every run is checked against
              both tensors' bounds before it is issued: a raw pointer has no bounds of its own.

Why it matters: a spill's scattered source is one run per block, and the host time to issue a
move's first chunk is time the link may sit idle (a spill's and a restore's first chunks took
4.3-7.0 ms to enqueue through torch on an H200 host and 3.0-4.4 ms this way, while they take ~5.5 ms
to cross; 64 scattered 2 MiB DMAs 940 vs 526 µs: bench/results/moves-probe-2026-12-04-h200-run4.json).
``bench/moves.py --torch-dma`` measures the engine with the torch path for comparison.

What torch's copy_ does beyond the copy and this skips: recording an event for memory that came
from torch's caching host allocator. Every host buffer here is the engine's own registered memory
(``PinnedBudget``), whose reuse the engine orders by its own events.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_CUDA_MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: direction from the pointers (unified addressing)


def _row_bytes(t: torch.Tensor, what: str) -> int:
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 2-D tensor of rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0) * t.element_size()


class TorchDma:
    name = "torch"

    def copy_runs(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy rows ``src[a:a+n]`` to ``dst[b:b+n]`` for each run (a, b, n), enqueued on ``stream``
        (already the current stream on a GPU; None on CPU)."""
        for a, b, n in runs:
            dst[b : b + n].copy_(src[a : a + n], non_blocking=True)


class RawDma:
    name = "cudaMemcpyAsync"

    def __init__(self, memcpy_async, error_string):
        self._memcpy = memcpy_async
        self._error_string = error_string

    @classmethod
    def load(cls) -> "RawDma | None":
        """The runtime torch loaded, or None where there is none to find (CPU builds, static links)."""
        path = _mapped_cudart()
        if path is None:
            return None
        # Already mapped: the same handle, the same runtime instance. PyDLL, not CDLL: the call
        # keeps the GIL, as torch's copy_ does; it only queues a copy (a few µs), so there is
        # nothing to gain from handing the GIL to the worker's other threads once per DMA. (On one
        # H200 host, bench/control.py's 2 GiB spill through a worker: control overhead p50
        # 0.435/0.468 ms with CDLL, 0.421/0.503 with PyDLL, alternating: no difference seen.)
        lib = ctypes.PyDLL(path)
        memcpy = lib.cudaMemcpyAsync
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        err_str = lib.cudaGetErrorString
        err_str.argtypes = [ctypes.c_int]
        err_str.restype = ctypes.c_char_p
        return cls(memcpy, err_str)

    def copy_runs(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
        rb = _row_bytes(src, "DMA source")
        if _row_bytes(dst, "DMA destination") != rb or dst.dtype != src.dtype:
            raise ValueError(f"DMA rows differ: source {src.dtype} x {src.shape[1]}, destination "
                             f"{dst.dtype} x {dst.shape[1]}")
        s_rows, d_rows = src.shape[0], dst.shape[0]
        for a, b, n in runs:          # every run checked before any is issued
            if n < 1 or a < 0 or b < 0 or a + n > s_rows or b + n > d_rows:
                raise IndexError(f"DMA run (source row {a}, destination row {b}, {n} rows) is outside "
                                 f"source rows [0, {s_rows}) or destination rows [0, {d_rows})")
        s0, d0, handle, memcpy = src.data_ptr(), dst.data_ptr(), stream.cuda_stream, self._memcpy
        for a, b, n in runs:
            err = memcpy(d0 + b * rb, s0 + a * rb, n * rb, _CUDA_MEMCPY_DEFAULT, handle)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync of {n * rb} bytes failed: cudaError {err} "
                                   f"({self._error_string(err).decode(errors='replace')})")


def _mapped_cudart(maps: str | None = None, cuda_version: str | None = None) -> str | None:
    """The path of the CUDA runtime mapped into this process: the one whose major version is
    torch's (``torch.version.cuda``) when several are (another extension may bring its own), else
    the first; None when none is (a CPU build, or torch linked it statically)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    paths = []
    for line in maps.splitlines():
        if "libcudart.so" in line:
            path = line.split(None, 5)[-1].strip()
            if path not in paths:
                paths.append(path)
    if not paths:
        return None
    major = (cuda_version if cuda_version is not None else (torch.version.cuda or "")).split(".")[0]
    for path in paths:
        if major and f"libcudart.so.{major}" in path:
            return path
    return paths[0]


def dma_issuer(device: torch.device, raw: bool = True) -> TorchDma | RawDma:
    """RawDma on a GPU when the runtime can be found and ``raw``; TorchDma otherwise."""
    if device.type == "cuda" and raw:
        found = RawDma.load()
        if found is not None:
            return found
    return TorchDma()
