"""Issuing DMAs by runs of rows: the torch path and the raw cudaMemcpyAsync path copy the same
bytes, and the raw path refuses a run outside either tensor before issuing anything.

On CPU the raw path runs with ``ctypes.memmove`` standing in for cudaMemcpyAsync (host pointers,
same arithmetic); on a GPU with the runtime torch loaded."""
import ctypes
from types import SimpleNamespace

import pytest
import torch

from residency.dataplane.moves.copy import coalesce
from residency.dataplane.moves.dma import RawDma, TorchDma, dma_issuer

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
NO_STREAM = SimpleNamespace(cuda_stream=0)


def _memmove_issuer(calls=None, batched=False) -> RawDma:
    def memcpy(dst, src, n, kind, stream):
        if calls is not None:
            calls.append((dst, src, n, kind, stream))
        ctypes.memmove(dst, src, n)
        return 0

    def batch(dsts, srcs, sizes, count, stream):
        if calls is not None:
            calls.append(("batch", list(dsts[:count]), list(srcs[:count]), list(sizes[:count]), stream))
        for i in range(count):
            ctypes.memmove(dsts[i], srcs[i], sizes[i])
        return 0
    return RawDma(memcpy, lambda err: b"test", batch if batched else None)


def _rows(n, words, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("issuer", [TorchDma(), _memmove_issuer(), _memmove_issuer(batched=True)],
                         ids=["torch", "raw", "raw-batch"])
def test_scattered_runs_land_where_the_slots_say(issuer):
    src, dst = _rows(23, 37, 1), _rows(19, 37, 2)
    expect = dst.clone()
    src_slots, dst_slots = [7, 8, 9, 3, 4, 22, 0], [0, 1, 2, 3, 4, 18, 11]
    for s, d in zip(src_slots, dst_slots):
        expect[d] = src[s]
    issuer.copy_runs(NO_STREAM, dst, src, coalesce(src_slots, dst_slots))
    assert torch.equal(dst, expect)


def test_raw_issues_one_copy_per_run_with_the_rows_addresses():
    calls = []
    src, dst = _rows(10, 5, 3), _rows(10, 5, 4)
    _memmove_issuer(calls).copy_runs(SimpleNamespace(cuda_stream=77), dst, src, [(7, 0, 3), (3, 3, 2)])
    rb = 5 * 4
    assert calls == [(dst.data_ptr(), src.data_ptr() + 7 * rb, 3 * rb, 4, 77),
                     (dst.data_ptr() + 3 * rb, src.data_ptr() + 3 * rb, 2 * rb, 4, 77)]


def test_a_batch_issues_every_run_of_a_call_in_one_call_and_a_lone_run_alone():
    calls = []
    src, dst = _rows(10, 5, 3), _rows(10, 5, 4)
    issuer = _memmove_issuer(calls, batched=True)
    issuer.copy_runs(SimpleNamespace(cuda_stream=77), dst, src, [(7, 0, 3), (3, 3, 2), (0, 9, 1)])
    rb = 5 * 4
    assert calls == [("batch", [dst.data_ptr(), dst.data_ptr() + 3 * rb, dst.data_ptr() + 9 * rb],
                      [src.data_ptr() + 7 * rb, src.data_ptr() + 3 * rb, src.data_ptr()], [3 * rb, 2 * rb, rb], 77)]
    calls.clear()
    issuer.copy_runs(SimpleNamespace(cuda_stream=77), dst, src, [(1, 2, 4)])
    assert calls == [(dst.data_ptr() + 2 * rb, src.data_ptr() + rb, 4 * rb, 4, 77)]
    assert issuer.name == "cudaMemcpyBatchAsync"


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batch"])
@pytest.mark.parametrize("runs", [[(0, 0, 2), (9, 0, 2)], [(0, 9, 2)], [(0, 0, 0)], [(-1, 0, 1)],
                                  [(0, 0, 1), (2, 2, 1), (3, 9, 2)]],
                         ids=["source-end", "destination-end", "empty", "negative", "last-of-three"])
def test_raw_refuses_a_run_outside_the_rows_and_issues_nothing(runs, batched):
    calls = []
    src, dst = _rows(10, 5, 5), _rows(10, 5, 6)
    before = dst.clone()
    with pytest.raises(IndexError, match="outside"):
        _memmove_issuer(calls, batched).copy_runs(NO_STREAM, dst, src, runs)
    assert calls == [] and torch.equal(dst, before)


def test_raw_refuses_rows_of_another_width_or_a_strided_view():
    src, dst = _rows(4, 5, 7), _rows(4, 6, 8)
    with pytest.raises(ValueError, match="rows differ"):
        _memmove_issuer().copy_runs(NO_STREAM, dst, src, [(0, 0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        _memmove_issuer().copy_runs(NO_STREAM, _rows(4, 10, 9)[:, :5], src, [(0, 0, 1)])


def test_a_failed_copy_raises_with_the_runtime_error_named():
    bad = RawDma(lambda *a: 1, lambda err: b"invalid value")
    with pytest.raises(RuntimeError, match=r"cudaError 1 \(invalid value\)"):
        bad.copy_runs(NO_STREAM, _rows(2, 3, 1), _rows(2, 3, 2), [(0, 0, 1)])


def test_a_failed_batch_raises_with_the_runtime_error_named():
    bad = RawDma(lambda *a: 0, lambda err: b"invalid value", lambda *a: 1)
    with pytest.raises(RuntimeError, match=r"cudaMemcpyBatchAsync of 2 runs failed: cudaError 1 \(invalid value\)"):
        bad.copy_runs(NO_STREAM, _rows(3, 3, 1), _rows(3, 3, 2), [(0, 0, 1), (2, 2, 1)])


class _FakeRuntime:
    """A runtime with a version and a cudaMemcpyBatchAsync that records its arguments."""

    def __init__(self, version, has_batch=True):
        self.calls = []

        def get_version(ref):
            ref._obj.value = version
            return 0
        self.cudaRuntimeGetVersion = get_version
        if has_batch:
            self.cudaMemcpyBatchAsync = lambda *args: self.calls.append(args) or 0


@pytest.mark.parametrize("version,n_args", [(12080, 9), (12090, 9), (13000, 8), (13020, 8)])
def test_the_batch_is_bound_with_the_signature_of_the_runtime_version(version, n_args):
    from residency.dataplane.moves.dma import _MemcpyAttributes, _bind_batch

    rt = _FakeRuntime(version)
    batch, why = _bind_batch(rt)
    assert why is None
    assert batch("d", "s", "z", 3, 99) == 0
    (args,) = rt.calls
    assert len(args) == n_args and args[:4] == ("d", "s", "z", 3) and args[-1] == 99 and args[6] == 1
    attrs = ctypes.cast(args[4], ctypes.POINTER(_MemcpyAttributes)).contents
    assert (attrs.src_access_order, attrs.flags, attrs.src_loc_type, attrs.dst_loc_type) == (1, 1, 0, 0)
    assert list(args[5]) == [0]
    assert ctypes.sizeof(_MemcpyAttributes) == 24


def test_no_batch_before_12_8_or_without_the_symbol():
    from residency.dataplane.moves.dma import _bind_batch

    assert _bind_batch(_FakeRuntime(12060))[0] is None
    batch, why = _bind_batch(_FakeRuntime(12090, has_batch=False))
    assert batch is None and "no cudaMemcpyBatchAsync" in why


def test_a_batch_that_fails_its_check_is_not_used_and_the_reason_is_kept():
    landed_elsewhere = lambda dsts, srcs, sizes, count, stream: 0      # "succeeds", copies nothing
    for batch in (landed_elsewhere, lambda *a: 1):
        dma = RawDma.checked(lambda *a: 0, lambda err: b"invalid value", batch)
        assert dma._batch is None and dma.name == "cudaMemcpyAsync"
        assert dma.batch_refused and "cudaMemcpyBatchAsync's check" in dma.batch_refused, dma.batch_refused
    dma = RawDma.checked(lambda *a: 0, lambda err: b"x", None, "runtime 12060 has no cudaMemcpyBatchAsync")
    assert dma.batch_refused == "runtime 12060 has no cudaMemcpyBatchAsync"


def test_cpu_movers_issue_through_torch():
    assert isinstance(dma_issuer(torch.device("cpu")), TorchDma)


@gpu
@pytest.mark.parametrize("batch", [True, False], ids=["batch", "one-by-one"])
def test_on_a_gpu_the_raw_path_moves_scattered_rows_both_ways(batch):
    dma = RawDma.load(batch=batch)
    assert isinstance(dma, RawDma), "the CUDA runtime torch loaded was not found in /proc/self/maps"
    dev = _rows(64, 4096, 11).cuda()
    host = torch.empty((64, 4096), dtype=torch.int32).pin_memory()
    s = torch.cuda.Stream()
    order = torch.randperm(64, generator=torch.Generator().manual_seed(12)).tolist()
    with torch.cuda.stream(s):
        dma.copy_runs(s, host, dev, coalesce(order, range(64)))            # device -> host, scattered
    s.synchronize()
    assert torch.equal(host, dev.cpu()[order])
    back = torch.empty_like(dev)
    with torch.cuda.stream(s):
        dma.copy_runs(s, back, host, coalesce(range(64), order))           # and home again
    s.synchronize()
    assert torch.equal(back, dev)


def test_the_runtime_found_is_torchs_own_major_version_when_several_are_mapped():
    from residency.dataplane.moves.dma import _mapped_cudart

    maps = ("7f00-7f01 r-xp 00000000 08:01 11 /opt/x/lib/libcudart.so.11.0\n"
            "7f02-7f03 r--p 00000000 08:01 12 /usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f04-7f05 r-xp 00001000 08:01 12 /usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f06-7f07 r-xp 00000000 08:01 13 /lib/libc.so.6\n")
    assert _mapped_cudart(maps, "12.8") == "/usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert _mapped_cudart(maps, "13.0") == "/opt/x/lib/libcudart.so.11.0"        # none matches: the first
    assert _mapped_cudart(maps.splitlines()[3], "12.8") is None                  # none mapped


@gpu
def test_on_a_gpu_the_batch_is_used_where_the_runtime_has_it():
    dma = dma_issuer(torch.device("cuda"))
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    if (major, minor) >= (12, 8):
        assert dma.name == "cudaMemcpyBatchAsync" and dma.batch_refused is None, dma.batch_refused
    else:
        assert dma.name == "cudaMemcpyAsync" and "no cudaMemcpyBatchAsync" in dma.batch_refused


def test_the_mover_copies_by_plain_dmas_only_where_they_go_in_batches():
    from residency.dataplane.mover import copy_modes_for

    assert copy_modes_for(_memmove_issuer(batched=True)) == {"d2h": "dma", "h2d": "dma"}
    assert copy_modes_for(_memmove_issuer()) == {"d2h": "staged", "h2d": "staged"}
    assert copy_modes_for(TorchDma()) == {"d2h": "staged", "h2d": "staged"}


def test_a_movers_copy_mode_follows_its_issuer(tmp_path):
    from tests.dataplane.helpers_dataplane import BatchedTorchDma, make_mover

    with make_mover(tmp_path) as e:                              # CPU: torch copies, staged
        assert e.ctx.copy_modes == {"d2h": "staged", "h2d": "staged"}
    with make_mover(tmp_path / "b", dma=BatchedTorchDma()) as e:
        assert e.ctx.copy_modes == {"d2h": "dma", "h2d": "dma"}
    with make_mover(tmp_path / "c", dma=_memmove_issuer(batched=True)) as e:
        assert e.ctx.copy_modes == {"d2h": "dma", "h2d": "dma"}


@gpu
def test_on_a_gpu_with_batches_the_mover_copies_by_plain_dmas(tmp_path):
    from tests.dataplane.helpers_dataplane import make_mover

    with make_mover(tmp_path, device="cuda") as e:
        batched = e.ctx.dma.batched
        assert batched == (e.ctx.dma.name == "cudaMemcpyBatchAsync")
        assert e.ctx.copy_modes == ({"d2h": "dma", "h2d": "dma"} if batched else {"d2h": "staged", "h2d": "staged"})


def _memmove_2d(issuer: RawDma) -> RawDma:
    """``cudaMemcpy2DAsync`` stood in for by one ``memmove`` per row (host pointers, same pitches)."""
    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return 0
    issuer._memcpy2d = memcpy2d
    return issuer


@pytest.mark.parametrize("issuer", [TorchDma(), _memmove_2d(_memmove_issuer())], ids=["torch", "raw-2d"])
def test_band_rows_land_in_their_columns_of_the_slots_rows(issuer):
    """A restore from disk's copy: rows of a band (staging) into columns [lo, lo + band) of scattered
    block rows; the other columns and rows untouched."""
    band, lo = _rows(9, 12, 11), 24
    dst = _rows(19, 60, 12)
    expect = dst.clone()
    dst_slots = [4, 5, 6, 0, 17, 18, 9, 2, 3]
    for k, d in enumerate(dst_slots):
        expect[d, lo:lo + 12] = band[k]
    issuer.copy_rows_to_cols(NO_STREAM, dst, band, coalesce(range(9), dst_slots), lo)
    assert torch.equal(dst, expect)


def test_raw_refuses_a_band_outside_the_rows_or_their_columns_and_issues_nothing():
    band, dst = _rows(4, 12, 13), _rows(6, 60, 14)
    before = dst.clone()
    issuer = _memmove_2d(_memmove_issuer())
    with pytest.raises(IndexError, match="outside"):
        issuer.copy_rows_to_cols(NO_STREAM, dst, band, [(0, 0, 2), (2, 5, 2)], 0)
    with pytest.raises(ValueError, match="do not fit columns"):
        issuer.copy_rows_to_cols(NO_STREAM, dst, band, [(0, 0, 1)], 50)
    assert torch.equal(dst, before)
