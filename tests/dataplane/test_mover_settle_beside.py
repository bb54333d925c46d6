"""Moves in flight together are settled as their bytes land: waiting for one move, the mover
settles the others whose device work is over (Mover._settle_landed_beside), never one whose
bytes are still crossing, never an early start, and never ahead of a small move."""
import pytest
import torch

from residency.events.catalog import MoveAcked
from tests.dataplane.helpers_dataplane import commit, make_mover, move, words_of

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
N = 13           # blocks per move: several chunks of 4


def _mover(tmp_path, device="cpu"):
    return make_mover(tmp_path, device=device, device_blocks=2 * N + 4, host_blocks=2 * N + 4, pipeline_blocks=4)


def _pair(e):
    """A spill of out_ids and a restore of in_ids (spilled first), submitted together."""
    out_ids, in_ids = list(range(1, N + 1)), list(range(100, 100 + N))
    data = commit(e, "device", out_ids + in_ids)
    assert isinstance(e.execute(move("evict", "device", "host", in_ids)), MoveAcked)
    return out_ids, in_ids, data


def _check_bytes(e, out_ids, in_ids, data):
    for b in in_ids:
        assert torch.equal(words_of(e, "device", b), data[b]), b
    for b in out_ids:
        assert torch.equal(words_of(e, "host", b), data[b]), b
    e.check_integrity()


def test_waiting_for_one_move_settles_the_other_that_has_landed(tmp_path):
    with _mover(tmp_path) as e:
        out_ids, in_ids, data = _pair(e)
        t_out, t_in = e.submit_many([move("evict", "device", "host", out_ids[::-1]),
                                     move("restore", "host", "device", in_ids)])
        ack_in = e.wait(t_in)
        early = e.outcome_of(t_out.move_id)                 # settled beside the restore
        assert isinstance(early, MoveAcked) and isinstance(ack_in, MoveAcked)
        assert early.finished_ns <= ack_in.finished_ns
        assert e.wait(t_out) is early                       # its own wait answers the same outcome
        _check_bytes(e, out_ids, in_ids, data)


def test_a_move_of_one_chunk_does_not_wait_behind_the_others(tmp_path):
    with _mover(tmp_path) as e:
        out_ids, in_ids, data = _pair(e)
        t_out = e.submit(move("evict", "device", "host", out_ids))
        t_in = e.submit(move("restore", "host", "device", in_ids[:4]))      # one chunk
        while e.pump():                                     # the spill all enqueued (landed, on CPU)
            pass
        assert isinstance(e.wait(t_in), MoveAcked)
        assert e.outcome_of(t_out.move_id) is None
        assert isinstance(e.wait(t_out), MoveAcked)
        e.check_integrity()


def test_moves_started_together_in_one_chunk_each_are_each_left_to_their_own_wait(tmp_path):
    # submit_many gives each move a first chunk of two pipeline chunks: 6 blocks go in one
    with _mover(tmp_path) as e:
        out_ids, in_ids, data = _pair(e)
        t_out, t_in = e.submit_many([move("evict", "device", "host", out_ids),
                                     move("restore", "host", "device", in_ids[:6])])
        while e.pump():                                     # the spill all enqueued (landed, on CPU)
            pass
        assert isinstance(e.wait(t_in), MoveAcked)
        assert e.outcome_of(t_out.move_id) is None
        assert isinstance(e.wait(t_out), MoveAcked)
        e.check_integrity()


def test_an_early_start_is_never_settled_beside_another_move(tmp_path):
    with _mover(tmp_path) as e:
        out_ids, in_ids, data = _pair(e)
        assert e.begin_ahead(move("evict", "device", "host", out_ids, move_id="m-ahead"))
        assert isinstance(e.execute(move("restore", "host", "device", in_ids)), MoveAcked)
        assert e.outcome_of("m-ahead") is None                              # its command has not come
        assert all(e.device_pool.has(b) and not e.host_pool.has(b) for b in out_ids)
        assert isinstance(e.wait("m-ahead"), MoveAcked)
        _check_bytes(e, out_ids, in_ids, data)


def test_a_move_that_cannot_say_whether_it_landed_is_left_to_its_own_wait(tmp_path):
    with _mover(tmp_path) as e:
        out_ids, in_ids, data = _pair(e)
        t_out, t_in = e.submit_many([move("evict", "device", "host", out_ids),
                                     move("restore", "host", "device", in_ids)])

        def broken():
            raise RuntimeError("event query failed")
        e._inflight[t_out.move_id].device_done = broken
        assert isinstance(e.wait(t_in), MoveAcked)
        assert e.outcome_of(t_out.move_id) is None
        assert isinstance(e.wait(t_out), MoveAcked)
        _check_bytes(e, out_ids, in_ids, data)


def _held_pair(e, held):
    """The pair submitted together on the GPU with ``held`` (a copy stream) kept busy ~50 ms
    first, and the restore waited for: (out_ids, in_ids, data, spill ticket, restore's ack)."""
    out_ids, in_ids, data = _pair(e)
    with torch.cuda.stream(held):
        torch.cuda._sleep(100_000_000)
    t_out, t_in = e.submit_many([move("evict", "device", "host", out_ids),
                                 move("restore", "host", "device", in_ids)])
    ack_in = e.wait(t_in)
    assert isinstance(ack_in, MoveAcked)
    return out_ids, in_ids, data, t_out, ack_in


@gpu
def test_on_the_gpu_a_landed_spill_is_settled_while_the_restore_still_crosses(tmp_path):
    with _mover(tmp_path, "cuda:0") as e:
        out_ids, in_ids, data, t_out, ack_in = _held_pair(e, e.streams.h2d)      # the restore waits
        ack_out = e.outcome_of(t_out.move_id)
        assert isinstance(ack_out, MoveAcked) and ack_out.finished_ns < ack_in.finished_ns
        _check_bytes(e, out_ids, in_ids, data)


@gpu
def test_on_the_gpu_a_spill_still_crossing_is_left_to_its_own_wait(tmp_path):
    with _mover(tmp_path, "cuda:0") as e:
        out_ids, in_ids, data, t_out, ack_in = _held_pair(e, e.streams.d2h)      # the spill waits
        assert e.outcome_of(t_out.move_id) is None
        ack_out = e.wait(t_out)
        assert isinstance(ack_out, MoveAcked) and ack_out.finished_ns > ack_in.finished_ns
        _check_bytes(e, out_ids, in_ids, data)
