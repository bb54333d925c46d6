"""Moves in flight: opposite directions overlap; on a GPU, copies are ordered against the
compute stream, and a restore is not done (nor its blocks readable) before its copy landed."""
import pytest
import torch

from residency.events.catalog import MoveAcked
from tests.dataplane.helpers_dataplane import LAYOUT, commit, make_mover, move, release, words_of

BB = LAYOUT.block_bytes
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_a_spill_and_a_restore_in_flight_together_both_land(mover):
    data = commit(mover, "device", [1, 2, 3, 4, 5, 6])
    mover.execute(move("evict", "device", "host", [4, 5, 6]))
    out_t = mover.submit(move("evict", "device", "host", [1, 2, 3]))
    in_t = mover.submit(move("restore", "host", "device", [6, 4, 5]))
    mover.check_integrity()                                 # mid-flight invariants hold too
    assert isinstance(mover.wait(in_t), MoveAcked) and isinstance(mover.wait(out_t), MoveAcked)
    for b in (4, 5, 6):
        assert torch.equal(words_of(mover, "device", b), data[b])
    for b in (1, 2, 3):
        assert torch.equal(words_of(mover, "host", b), data[b])


def test_waiting_twice_or_on_a_settled_move_returns_the_same_outcome(mover):
    commit(mover, "device", [1])
    t = mover.submit(move("spill", "device", "host", [1]))
    first = mover.wait(t)
    assert mover.wait(t) is first and mover.wait(t.move_id) is first


def test_close_settles_moves_still_in_flight(tmp_path, mover_device):
    e = make_mover(tmp_path, device=mover_device)
    commit(e, "device", [1])
    t = e.submit(move("evict", "device", "host", [1]))
    e.close()
    assert isinstance(e.outcome_of(t.move_id), MoveAcked) and e.pinned.in_use_bytes == 0


@gpu
def test_a_spill_reads_what_the_compute_stream_wrote_before_it(tmp_path):
    with make_mover(tmp_path, device="cuda:0") as e:
        commit(e, "device", [1])
        slot = e.device_pool.slot_of(1)
        torch.cuda._sleep(200_000_000)                      # the compute stream is busy ...
        e.device_pool.words[slot].fill_(1234567)            # ... then writes the block
        ack = e.execute(move("spill", "device", "host", [1]))
        assert isinstance(ack, MoveAcked)
        assert bool((e.host_pool.words[e.host_pool.slot_of(1)] == 1234567).all())


@gpu
def test_a_restore_is_acked_only_after_its_copy_landed(tmp_path):
    with make_mover(tmp_path, device="cuda:0") as e:
        data = commit(e, "device", [1, 2])
        e.execute(move("evict", "device", "host", [1, 2]))
        with torch.cuda.stream(e.streams.h2d):
            torch.cuda._sleep(200_000_000)                  # the copy stream is held back
        ticket = e.submit(move("restore", "host", "device", [2, 1]))
        out = e.wait(ticket)
        assert isinstance(out, MoveAcked)
        slots = e.device_pool.block_table([1, 2]).long()
        seen = e.device_pool.words[slots].cpu()             # read on the compute stream, at once
        assert torch.equal(seen[0], data[1]) and torch.equal(seen[1], data[2])


@gpu
def test_a_restore_waits_for_readers_of_the_slots_it_overwrites(tmp_path):
    with make_mover(tmp_path, device="cuda:0", device_blocks=2) as e:
        commit(e, "device", [1])
        commit(e, "host", [2])
        slot = e.device_pool.slot_of(1)
        want = e.device_pool.words[slot].cpu()
        torch.cuda._sleep(200_000_000)
        seen = e.device_pool.words[slot].clone()            # a reader still queued on the compute stream
        release(e, "device", [1])                           # the slot is free on the host side already
        assert isinstance(e.execute(move("restore", "host", "device", [2])), MoveAcked)
        assert e.device_pool.slot_of(2) == slot             # the restore reused that very slot
        assert torch.equal(seen.cpu(), want)                # and the reader still saw the old bytes

