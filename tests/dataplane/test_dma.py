"""Issuing DMAs by runs of rows: the torch path and the raw cudaMemcpyAsync path copy the same
bytes, and the raw path refuses a run outside either tensor before issuing anything.

On CPU the raw path runs with ``ctypes.memmove`` standing in for cudaMemcpyAsync (host pointers,
same arithmetic); on a GPU with the runtime torch loaded."""
import ctypes
from types import SimpleNamespace

import pytest
import torch

from dataplane.moves.copy import coalesce
from dataplane.moves.dma import RawDma, TorchDma, dma_issuer

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
NO_STREAM = SimpleNamespace(cuda_stream=0)


def _memmove_issuer(calls=None) -> RawDma:
    def memcpy(dst, src, n, kind, stream):
        if calls is not None:
            calls.append((dst, src, n, kind, stream))
        ctypes.memmove(dst, src, n)
        return 0
    return RawDma(memcpy, lambda err: b"test")


def _rows(n, words, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("issuer", [TorchDma(), _memmove_issuer()], ids=["torch", "raw"])
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


@pytest.mark.parametrize("runs", [[(0, 0, 2), (9, 0, 2)], [(0, 9, 2)], [(0, 0, 0)], [(-1, 0, 1)]],
                         ids=["source-end", "destination-end", "empty", "negative"])
def test_raw_refuses_a_run_outside_the_rows_and_issues_nothing(runs):
    calls = []
    src, dst = _rows(10, 5, 5), _rows(10, 5, 6)
    before = dst.clone()
    with pytest.raises(IndexError, match="outside"):
        _memmove_issuer(calls).copy_runs(NO_STREAM, dst, src, runs)
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


def test_cpu_engines_issue_through_torch():
    assert isinstance(dma_issuer(torch.device("cpu")), TorchDma)


@gpu
def test_on_a_gpu_the_raw_path_moves_scattered_rows_both_ways():
    dma = dma_issuer(torch.device("cuda"))
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
    from dataplane.moves.dma import _mapped_cudart

    maps = ("7f00-7f01 r-xp 00000000 08:01 11 /opt/x/lib/libcudart.so.11.0\n"
            "7f02-7f03 r--p 00000000 08:01 12 /usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f04-7f05 r-xp 00001000 08:01 12 /usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12\n"
            "7f06-7f07 r-xp 00000000 08:01 13 /lib/libc.so.6\n")
    assert _mapped_cudart(maps, "12.8") == "/usr/lib/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert _mapped_cudart(maps, "13.0") == "/opt/x/lib/libcudart.so.11.0"        # none matches: the first
    assert _mapped_cudart(maps.splitlines()[3], "12.8") is None                  # none mapped
