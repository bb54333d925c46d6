"""The bench's copy paths the mover does not take (bench/moves_variants.py): the "kernel" copy
mode and DMA lanes move the same bytes as the mover's own copies, and a move's completion covers
every lane. The figures compared against the mover are only as good as these paths are right."""
from __future__ import annotations

import contextlib
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from residency.events.catalog import MoveAcked
from tests.dataplane.helpers_dataplane import BatchedTorchDma, commit, make_mover, move, release, words_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from moves_variants import BenchCopier, Lanes  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _kernel_mover(tmp_path, **kw):
    e = make_mover(tmp_path, copier=BenchCopier, **kw)
    e.ctx.copy_modes.update(d2h="kernel", h2d="kernel")
    return e


def test_the_kernel_copy_mode_moves_the_same_bytes(tmp_path):
    with _kernel_mover(tmp_path, pipeline_blocks=2) as e:
        # non-consecutive slots on both sides, so the kernels' indices matter
        data = commit(e, "device", list(range(10)))
        release(e, "device", [1, 4, 7])
        out = e.execute(move("evict", "device", "host", [9, 0, 5, 6, 2]))
        back = e.execute(move("restore", "host", "device", [6, 2, 9, 0, 5]))
        assert back.checksum_list() == [out.checksum_list()[i] for i in (3, 4, 0, 1, 2)]
        for b in (0, 2, 3, 5, 6, 8, 9):
            assert torch.equal(words_of(e, "device", b), data[b])
        e.check_integrity()


def _must_not_run(*a, **k):
    raise AssertionError("the torch reference ran where the Triton kernel should have")


def test_the_kernel_copy_mode_runs_the_triton_kernels_under_the_interpreter(tmp_path, monkeypatch):
    from residency.kernels import checksum, gather, scatter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mod, name in ((gather, "gather_blocks_ref"), (scatter, "scatter_blocks_ref"),
                      (checksum, "block_checksums_ref")):
        monkeypatch.setattr(mod, name, _must_not_run)
    with _kernel_mover(tmp_path, pipeline_blocks=2) as e:
        data = commit(e, "device", [3, 1, 4, 5, 9])
        assert isinstance(e.execute(move("evict", "device", "host", [4, 3, 9, 5])), MoveAcked)
        assert isinstance(e.execute(move("restore", "host", "device", [3, 4, 5, 9])), MoveAcked)
        for b in data:
            assert torch.equal(words_of(e, "device", b), data[b])


class _Streams:
    """Named stand-ins for streams: records where each DMA went and what waited on what."""

    def __init__(self):
        self.cuda, self.device = True, None
        self.d2h, self.h2d, self.stage_d2h, self.stage_h2d = "d2h", "h2d", "stage_d2h", "stage_h2d"
        self.waits = []

    def on(self, stream):
        return contextlib.nullcontext()

    def compute_stream(self):
        return "compute"

    def wait_stream(self, stream, other):
        self.waits.append((stream, other))

    def mark(self, stream, spin=False):
        return ("event on", stream)


def _copier(lanes, mode="dma"):
    issued = []
    dma = type("Dma", (), {"copy_runs": lambda self, stream, dst, src, runs: issued.append((stream, runs))})()
    streams = _Streams()
    ctx = type("Ctx", (), {"streams": streams, "dma": dma, "copy_modes": {"d2h": mode, "h2d": mode}})()
    made = Lanes(lanes, make_stream=lambda device, direction, k: f"{direction}-{k}")
    return BenchCopier(ctx, "d2h", "src", list(range(10)), "dst", list(range(100, 110)), mode=mode,
                       lanes=made), issued, streams


def test_successive_chunks_go_round_the_lanes_and_done_joins_them_all():
    c, issued, s = _copier(lanes=2)
    assert s.waits == [("d2h-1", "compute")]          # the extra lane waits for the compute stream
    for lo in range(0, 10, 3):
        c.enqueue(lo, min(10, lo + 3))
    assert [stream for stream, _ in issued] == ["d2h", "d2h-1", "d2h", "d2h-1"]
    assert [runs for _, runs in issued][1] == [(3, 103, 3)]
    assert c.done() == ("event on", "d2h")
    assert s.waits[1:] == [("d2h", "d2h-1")]


def test_one_lane_issues_everything_on_the_direction_stream():
    c, issued, s = _copier(lanes=1)
    c.enqueue(0, 5)
    c.enqueue(5, 10)
    c.done()
    assert {stream for stream, _ in issued} == {"d2h"} and s.waits == []


def test_done_joins_every_lane_even_those_this_copier_never_used():
    # a move's first chunk has its own copier: its DMAs may sit on a lane its later chunks skip
    c, issued, s = _copier(lanes=3)
    c.enqueue(0, 10)
    c.done()
    assert [stream for stream, _ in issued] == ["d2h"]
    assert s.waits[-2:] == [("d2h", "d2h-1"), ("d2h", "d2h-2")]


def test_lanes_are_at_least_one_and_the_cpu_has_one_stand_in():
    from residency.dataplane.moves.streams import CopyStreams

    with pytest.raises(ValueError, match="dma lanes must be >= 1"):
        Lanes(0)
    assert Lanes(2).of(CopyStreams(torch.device("cpu")), "d2h") == [None]


def test_a_cpu_mover_with_two_lanes_moves_as_with_one(tmp_path):
    with make_mover(tmp_path, dma=BatchedTorchDma(), copier=partial(BenchCopier, lanes=Lanes(2))) as e:
        data = commit(e, "device", [1, 2, 3, 4])
        assert isinstance(e.execute(move("evict", "device", "host", [3, 1, 4, 2])), MoveAcked)
        assert isinstance(e.execute(move("restore", "host", "device", [2, 4, 1, 3])), MoveAcked)
        for b in (1, 2, 3, 4):
            assert torch.equal(words_of(e, "device", b), data[b])


@gpu
@pytest.mark.parametrize("n", [3, 20, 37])
def test_with_two_lanes_moves_submitted_together_are_acked_only_after_every_lane_landed(tmp_path, n):
    lanes = Lanes(2)
    with make_mover(tmp_path, device="cuda:0", device_blocks=2 * n + 4, host_blocks=2 * n + 4,
                    pipeline_blocks=4, dma=BatchedTorchDma(), copier=partial(BenchCopier, lanes=lanes)) as e:
        out_ids, in_ids = list(range(1, n + 1)), list(range(100, 100 + n))
        data = commit(e, "device", out_ids + in_ids)
        assert isinstance(e.execute(move("evict", "device", "host", in_ids)), MoveAcked)
        for lane in lanes.of(e.streams, "d2h")[1:] + lanes.of(e.streams, "h2d")[1:]:
            with torch.cuda.stream(lane):
                torch.cuda._sleep(100_000_000)          # the second lanes are held back
        t_out, t_in = e.submit_many([move("evict", "device", "host", out_ids[::-1]),
                                     move("restore", "host", "device", in_ids[::-1])])
        assert isinstance(e.wait(t_in), MoveAcked) and isinstance(e.wait(t_out), MoveAcked)
        dev = e.device_pool.words[e.device_pool.block_table(in_ids).long()].cpu()    # read at once
        host = e.host_pool.words[torch.tensor([e.host_pool.slot_of(b) for b in out_ids])].clone()
        for k, b in enumerate(in_ids):
            assert torch.equal(dev[k], data[b]), b
        for k, b in enumerate(out_ids):
            assert torch.equal(host[k], data[b]), b
        e.check_integrity()
