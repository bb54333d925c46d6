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
move's first chunk is time the link may sit idle: through torch, enqueuing a first chunk takes
about as long as its bytes take to cross; this way, about half as long.
``bench/moves.py --torch-dma`` measures the mover with the torch path for comparison.

Where the runtime has ``cudaMemcpyBatchAsync`` (CUDA 12.8 on), RawDma issues all the runs of one
call in one batch (one call into the runtime instead of one per run; the batch goes in stream
order, by the copy engines: ``cudaMemcpyFlagPreferOverlapWithCompute``). The copies of one batch
may run in any order, which is safe because a call's runs never share a destination row (each
block has its own claimed slot). Before it is trusted, a load checks it on scattered rows of
device scratch memory; where that check fails, the runs go one ``cudaMemcpyAsync`` each and
``batch_refused`` says why.

What torch's copy_ does beyond the copy and this skips: recording an event for memory that came
from torch's caching host allocator. Every host buffer here is the mover's own registered memory
(``PinnedBudget``), whose reuse the mover orders by its own events.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_CUDA_MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: direction from the pointers (unified addressing)
_SRC_ACCESS_ORDER_STREAM = 1      # cudaMemcpySrcAccessOrderStream: sources read in stream order
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute: copy engines, not SMs



def _check_runs(runs: Sequence[tuple[int, int, int]], s_rows: int, d_rows: int) -> None:
    """Every run (source row, destination row, rows) inside both tensors' rows, or IndexError."""
    for a, b, n in runs:
        if n < 1 or a < 0 or b < 0 or a + n > s_rows or b + n > d_rows:
            raise IndexError(f"DMA run (source row {a}, destination row {b}, {n} rows) is outside "
                             f"source rows [0, {s_rows}) or destination rows [0, {d_rows})")

class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (driver_types.h, CUDA 12.8 on): the access order, two location hints
    (cudaMemLocation: type, id; type 0 = no hint) and flags."""
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int), ("src_loc_id", ctypes.c_int),
                ("dst_loc_type", ctypes.c_int), ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


def _row_bytes(t: torch.Tensor, what: str) -> int:
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 2-D tensor of rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0) * t.element_size()


class TorchDma:
    name = "torch"
    batched = False              # every run its own copy_

    def copy_runs(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
        """Copy rows ``src[a:a+n]`` to ``dst[b:b+n]`` for each run (a, b, n), enqueued on ``stream``
        (already the current stream on a GPU; None on CPU)."""
        for a, b, n in runs:
            dst[b : b + n].copy_(src[a : a + n], non_blocking=True)

    def copy_runs_cols(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]],
                       lo: int, hi: int) -> None:
        """``copy_runs`` of columns [lo, hi) of each row only (one layer of a block: a layer-ordered
        restore, dataplane/moves/layered.py)."""
        for a, b, n in runs:
            dst[b : b + n, lo:hi].copy_(src[a : a + n, lo:hi], non_blocking=True)

    def copy_rows_to_cols(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]],
                          lo: int) -> None:
        """Whole rows of ``src`` (a band of a block's layers each: ``src.shape[1]`` words) into
        columns [lo, lo + that) of rows of ``dst``: ``src[a:a+n]`` to ``dst[b:b+n, lo:...]`` per run
        (a restore from disk: a band read into staging, then copied to its place in each block)."""
        w = src.shape[1]
        for a, b, n in runs:
            dst[b : b + n, lo : lo + w].copy_(src[a : a + n], non_blocking=True)


class RawDma:
    name = "cudaMemcpyAsync"

    def __init__(self, memcpy_async, error_string, batch=None):
        """``batch``: None, or ``batch(dsts, srcs, sizes, count, stream) -> error`` over ctypes
        arrays of addresses and sizes (``cudaMemcpyBatchAsync`` bound by ``load``)."""
        self._memcpy = memcpy_async
        self._error_string = error_string
        self._batch = batch
        self._memcpy2d = None            # cudaMemcpy2DAsync, bound by ``load`` (copy_runs_cols)
        self.batch_refused: str | None = None
        if batch is not None:
            self.name = "cudaMemcpyBatchAsync"

    @classmethod
    def load(cls, batch: bool = True) -> "RawDma | None":
        """The runtime torch loaded, or None where there is none to find (CPU builds, static links);
        issuing in batches where it can and ``batch``."""
        path = _mapped_cudart()
        if path is None:
            return None
        # Already mapped: the same handle, the same runtime instance. PyDLL, not CDLL: the call
        # keeps the GIL, as torch's copy_ does; it only queues a copy (a few µs), so there is
        # nothing to gain from handing the GIL to the worker's other threads once per DMA (a
        # spill through a worker showed the same control overhead either way).
        lib = ctypes.PyDLL(path)
        memcpy = lib.cudaMemcpyAsync
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        err_str = lib.cudaGetErrorString
        err_str.argtypes = [ctypes.c_int]
        err_str.restype = ctypes.c_char_p
        dma = cls.checked(memcpy, err_str, *(_bind_batch(lib) if batch else (None, "not asked for (batch=False)")))
        try:
            memcpy2d = lib.cudaMemcpy2DAsync
            sz = ctypes.c_size_t
            memcpy2d.argtypes = [ctypes.c_void_p, sz, ctypes.c_void_p, sz, sz, sz, ctypes.c_int, ctypes.c_void_p]
            memcpy2d.restype = ctypes.c_int
            dma._memcpy2d = memcpy2d
        except AttributeError:
            pass                         # torch's strided copy instead
        return dma

    @classmethod
    def checked(cls, memcpy_async, error_string, batch, why: str | None = None) -> "RawDma":
        """A RawDma that batches only if ``batch`` passes ``_check_batch``; otherwise one call per
        run, with ``batch_refused`` saying why (``why``: the binding's own reason for no batch)."""
        dma = cls(memcpy_async, error_string, batch)
        if batch is not None:
            why = dma._check_batch()
        if why is not None:
            dma._batch, dma.name, dma.batch_refused = None, cls.name, why
        return dma

    @property
    def batched(self) -> bool:
        """Whether a call's runs go in one cudaMemcpyBatchAsync (bound and past its check)."""
        return self._batch is not None

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
        s0, d0, handle = src.data_ptr(), dst.data_ptr(), stream.cuda_stream
        if self._batch is not None and len(runs) > 1:
            k = len(runs)
            err = self._batch((ctypes.c_void_p * k)(*[d0 + b * rb for _a, b, _n in runs]),
                              (ctypes.c_void_p * k)(*[s0 + a * rb for a, _b, _n in runs]),
                              (ctypes.c_size_t * k)(*[n * rb for _a, _b, n in runs]), k, handle)
            if err:
                raise RuntimeError(f"cudaMemcpyBatchAsync of {k} runs failed: cudaError {err} "
                                   f"({self._error_string(err).decode(errors='replace')})")
            return
        memcpy = self._memcpy
        for a, b, n in runs:
            err = memcpy(d0 + b * rb, s0 + a * rb, n * rb, _CUDA_MEMCPY_DEFAULT, handle)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync of {n * rb} bytes failed: cudaError {err} "
                                   f"({self._error_string(err).decode(errors='replace')})")

    def copy_runs_cols(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]],
                       lo: int, hi: int) -> None:
        """Columns [lo, hi) of each run's rows, one ``cudaMemcpy2DAsync`` per run (n rows of
        ``hi - lo`` columns, a row apart on both sides): one layer of a run of blocks in one call.
        Without the 2-D call bound, torch's copy of the strided views (correct, slower)."""
        if self._memcpy2d is None:
            TorchDma.copy_runs_cols(self, stream, dst, src, runs, lo, hi)
            return
        rb = _row_bytes(src, "DMA source")
        if _row_bytes(dst, "DMA destination") != rb or dst.dtype != src.dtype:
            raise ValueError(f"DMA rows differ: source {src.dtype} x {src.shape[1]}, destination "
                             f"{dst.dtype} x {dst.shape[1]}")
        if not 0 <= lo < hi <= src.shape[1]:
            raise IndexError(f"columns [{lo}, {hi}) are outside the rows' [0, {src.shape[1]})")
        _check_runs(runs, src.shape[0], dst.shape[0])
        es = src.element_size()
        off, width = lo * es, (hi - lo) * es
        self._copy_2d(stream, dst.data_ptr() + off, rb, src.data_ptr() + off, rb, width, runs)

    def copy_rows_to_cols(self, stream, dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]],
                          lo: int) -> None:
        """``TorchDma.copy_rows_to_cols``, one ``cudaMemcpy2DAsync`` per run (n rows, the source's
        row pitch and the destination's apart); torch's strided copy without the 2-D call bound."""
        if self._memcpy2d is None:
            TorchDma.copy_rows_to_cols(self, stream, dst, src, runs, lo)
            return
        spitch, dpitch = _row_bytes(src, "DMA source"), _row_bytes(dst, "DMA destination")
        w = src.shape[1]
        if dst.dtype != src.dtype or not 0 <= lo <= lo + w <= dst.shape[1]:
            raise ValueError(f"rows of {w} {src.dtype} do not fit columns [{lo}, {lo + w}) of rows of "
                             f"{dst.shape[1]} {dst.dtype}")
        _check_runs(runs, src.shape[0], dst.shape[0])
        es = src.element_size()
        self._copy_2d(stream, dst.data_ptr() + lo * es, dpitch, src.data_ptr(), spitch, w * es, runs)

    def _copy_2d(self, stream, d0: int, dpitch: int, s0: int, spitch: int, width: int,
                 runs: Sequence[tuple[int, int, int]]) -> None:
        """One ``cudaMemcpy2DAsync`` per run: ``n`` rows of ``width`` bytes from source row ``a``
        (``spitch`` apart from ``s0``) to destination row ``b`` (``dpitch`` apart from ``d0``)."""
        for a, b, n in runs:
            err = self._memcpy2d(d0 + b * dpitch, dpitch, s0 + a * spitch, spitch, width, n, _CUDA_MEMCPY_DEFAULT,
                                 stream.cuda_stream)
            if err:
                raise RuntimeError(f"cudaMemcpy2DAsync of {n} rows x {width} bytes failed: cudaError {err} "
                                   f"({self._error_string(err).decode(errors='replace')})")

    def _check_batch(self) -> str | None:
        """Scattered rows through the batch and back, device to device on a side stream (no host
        memory: nothing pinned outside the mover's budget); None when they land where they
        should, else why not."""
        try:
            g = torch.Generator().manual_seed(0x5EED)
            rows = torch.randint(-2**31, 2**31 - 1, (4, 1024), dtype=torch.int32, generator=g)
            dev = rows.cuda()
            # Destinations start as the bitwise complement of what should land (never left
            # uninitialised: the caching allocator hands back the blocks of an earlier check, which
            # already hold the right rows, and a batch that copied nothing would pass).
            there, back = torch.bitwise_not(dev[[3, 0, 1, 2]]), torch.bitwise_not(dev)
            s = torch.cuda.Stream(dev.device)
            s.wait_stream(torch.cuda.current_stream(dev.device))
            with torch.cuda.stream(s):
                self.copy_runs(s, there, dev, [(3, 0, 1), (0, 1, 2), (2, 3, 1)])
                self.copy_runs(s, back, there, [(1, 0, 2), (3, 2, 1), (0, 3, 1)])
            s.synchronize()
            if not torch.equal(there.cpu(), rows[[3, 0, 1, 2]]) or not torch.equal(back.cpu(), rows):
                return "cudaMemcpyBatchAsync's check: rows landed elsewhere"
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            return f"cudaMemcpyBatchAsync's check failed: {type(e).__name__}: {e}"
        return None


def _bind_batch(lib) -> tuple:
    """``(batch, None)``: cudaMemcpyBatchAsync of ``lib`` as ``batch(dsts, srcs, sizes, count,
    stream)``; ``(None, why)`` where the runtime has none (before 12.8)."""
    version = ctypes.c_int(0)
    try:
        get_version = lib.cudaRuntimeGetVersion
        get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
        get_version.restype = ctypes.c_int
        if get_version(ctypes.byref(version)):
            return None, "cudaRuntimeGetVersion failed"
        fn = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None, f"runtime {version.value} has no cudaMemcpyBatchAsync"
    if version.value < 12080:
        return None, f"runtime {version.value} has no cudaMemcpyBatchAsync"
    attrs = _MemcpyAttributes(src_access_order=_SRC_ACCESS_ORDER_STREAM, flags=_PREFER_OVERLAP_WITH_COMPUTE)
    attrs_idx = (ctypes.c_size_t * 1)(0)
    pp, sp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    head = [pp, pp, sp, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), sp, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    if version.value >= 13000:       # CUDA 13 dropped the failIdx out-parameter
        fn.argtypes = head + [ctypes.c_void_p]

        def batch(dsts, srcs, sizes, count, stream):
            return fn(dsts, srcs, sizes, count, ctypes.byref(attrs), attrs_idx, 1, stream)
    else:
        fn.argtypes = head + [sp, ctypes.c_void_p]
        fail_idx = ctypes.c_size_t(0)

        def batch(dsts, srcs, sizes, count, stream):
            return fn(dsts, srcs, sizes, count, ctypes.byref(attrs), attrs_idx, 1, ctypes.byref(fail_idx), stream)
    return batch, None


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


def dma_issuer(device: torch.device) -> TorchDma | RawDma:
    """RawDma on a GPU when the runtime can be found (issuing a call's runs in one batch where
    the runtime can); TorchDma otherwise (the CPU path, static builds)."""
    if device.type == "cuda":
        found = RawDma.load()
        if found is not None:
            return found
    return TorchDma()
