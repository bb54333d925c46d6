"""DMA lanes: the "dma" copy mode spreads a move's chunks over several streams per direction,
and a move's completion covers every lane (dataplane/moves/streams.py, copy.py)."""
from types import SimpleNamespace

import pytest
import torch

from residency.dataplane.moves.copy import Copier
from residency.dataplane.moves.streams import CopyStreams
from residency.events.catalog import MoveAcked
from tests.dataplane.helpers_dataplane import commit, make_engine, move, words_of

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class _Streams:
    """Named stand-ins for streams: records where each DMA went and what was joined."""

    def __init__(self, lanes):
        self.d2h, self.h2d, self.stage_d2h, self.stage_h2d = "d2h", "h2d", "stage_d2h", "stage_h2d"
        self._lanes = {"d2h": ["d2h", "d2h-1", "d2h-2"][:lanes], "h2d": ["h2d", "h2d-1", "h2d-2"][:lanes]}
        self.joined = []

    def lanes(self, direction):
        return self._lanes[direction]

    def on(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def join(self, stream, others):
        self.joined.append((stream, list(others)))

    def mark(self, stream, spin=False):
        return ("event on", stream)


def _copier(lanes, mode="dma"):
    issued = []
    dma = SimpleNamespace(copy_runs=lambda stream, dst, src, runs: issued.append((stream, runs)))
    ctx = SimpleNamespace(streams=_Streams(lanes), dma=dma, copy_modes={"d2h": mode, "h2d": mode})
    return Copier(ctx, "d2h", "src", list(range(10)), "dst", list(range(100, 110)), mode=mode), issued, ctx.streams


def test_successive_chunks_go_round_the_lanes_and_done_joins_them_all():
    c, issued, s = _copier(lanes=2)
    for lo in range(0, 10, 3):
        c.enqueue(lo, min(10, lo + 3))
    assert [stream for stream, _ in issued] == ["d2h", "d2h-1", "d2h", "d2h-1"]
    assert [runs for _, runs in issued][1] == [(3, 103, 3)]
    assert c.done() == ("event on", "d2h")
    assert s.joined == [("d2h", ["d2h", "d2h-1"])]


def test_one_lane_issues_everything_on_the_direction_stream():
    c, issued, _ = _copier(lanes=1)
    c.enqueue(0, 5)
    c.enqueue(5, 10)
    assert {stream for stream, _ in issued} == {"d2h"}


def test_done_joins_every_lane_even_those_this_copier_never_used():
    # a move's first chunk has its own copier: its DMAs may sit on a lane its later chunks skip
    c, issued, s = _copier(lanes=3)
    c.enqueue(0, 10)
    c.done()
    assert [stream for stream, _ in issued] == ["d2h"] and s.joined == [("d2h", ["d2h", "d2h-1", "d2h-2"])]


def test_lanes_are_at_least_one_and_the_cpu_has_one_stand_in():
    with pytest.raises(ValueError, match="dma lanes must be >= 1"):
        CopyStreams(torch.device("cpu"), lanes=0)
    s = CopyStreams(torch.device("cpu"), lanes=2)
    assert s.lanes("d2h") == [None] and s.with_lanes(None) == [None]


def test_a_cpu_engine_with_two_lanes_moves_as_with_one(tmp_path):
    with make_engine(tmp_path, dma_lanes=2, copy_modes={"d2h": "dma", "h2d": "dma"}) as e:
        data = commit(e, "device", [1, 2, 3, 4])
        assert isinstance(e.execute(move("evict", "device", "host", [3, 1, 4, 2])), MoveAcked)
        assert isinstance(e.execute(move("restore", "host", "device", [2, 4, 1, 3])), MoveAcked)
        for b in (1, 2, 3, 4):
            assert torch.equal(words_of(e, "device", b), data[b])


@gpu
@pytest.mark.parametrize("n", [3, 20, 37])
def test_with_two_lanes_moves_submitted_together_are_acked_only_after_every_lane_landed(tmp_path, n):
    modes = {"d2h": "dma", "h2d": "dma"}
    with make_engine(tmp_path, device="cuda:0", device_blocks=2 * n + 4, host_blocks=2 * n + 4, dma_lanes=2,
                     pipeline_blocks=4, copy_modes=modes) as e:
        out_ids, in_ids = list(range(1, n + 1)), list(range(100, 100 + n))
        data = commit(e, "device", out_ids + in_ids)
        assert isinstance(e.execute(move("evict", "device", "host", in_ids)), MoveAcked)
        for lane in e.streams.lanes("d2h")[1:] + e.streams.lanes("h2d")[1:]:
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
