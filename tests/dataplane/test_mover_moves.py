"""Every route moves bytes intact, reports what it measured, and is idempotent by move_id."""
import pytest
import torch

from residency.dataplane.moves.dma import TorchDma
from residency.events.catalog import MoveAcked, MoveRejected
from residency.kernels.checksum import block_checksums_ref, checksums_to_ints
from tests.dataplane.helpers_dataplane import (LAYOUT, BatchedTorchDma, assert_same, commit, make_mover, move, release,
                                               snapshot, words_of)

BB = LAYOUT.block_bytes


def psum(block, words):
    return checksums_to_ints(block_checksums_ref(words.view(1, -1), torch.tensor([0]), torch.tensor([block])))[0]


def test_spill_keeps_the_source_and_acks_measured_bytes_and_checksums(mover):
    data = commit(mover, "device", [4, 9, 2])
    ack = mover.execute(move("spill", "device", "host", [9, 2]))
    assert isinstance(ack, MoveAcked), ack
    assert (ack.bytes_moved, ack.bytes_freed_src, ack.checksum_ok) == (2 * BB, 0, True)
    assert ack.checksum_list() == [psum(9, data[9]), psum(2, data[2])]
    assert ack.started_ns <= ack.finished_ns
    for b in (9, 2):
        assert torch.equal(words_of(mover, "host", b), data[b])
        assert torch.equal(words_of(mover, "device", b), data[b])
    assert mover.usage()["device"] == 3 * BB and mover.usage()["host"] == 2 * BB


def test_evict_frees_the_device_copy_and_says_how_much(mover):
    data = commit(mover, "device", [1, 2, 3])
    ack = mover.execute(move("evict", "device", "host", [3, 1]))
    assert (ack.bytes_moved, ack.bytes_freed_src) == (2 * BB, 2 * BB)
    assert not mover.device_pool.has(1) and mover.device_pool.has(2)
    assert torch.equal(words_of(mover, "host", 3), data[3])


def test_park_then_restore_brings_back_identical_bytes_with_the_same_checksums(mover):
    data = commit(mover, "device", list(range(7)))
    park = mover.execute(move("park", "device", "host", [6, 0, 3, 5]))
    assert park.bytes_freed_src == 4 * BB
    back = mover.execute(move("restore", "host", "device", [3, 5, 0, 6]))
    assert isinstance(back, MoveAcked), back
    assert back.bytes_freed_src == 4 * BB                 # keep_source=False: host copies freed
    assert back.checksum_list() == [park.checksum_list()[i] for i in (2, 3, 1, 0)]
    for b in range(7):
        assert torch.equal(words_of(mover, "device", b), data[b])
    assert mover.usage()["host"] == 0


def test_a_block_travels_device_host_disk_host_device_unchanged(mover):
    data = commit(mover, "device", [10, 11, 12])
    assert mover.execute(move("evict", "device", "host", [10, 11, 12])).bytes_freed_src == 3 * BB
    assert mover.execute(move("demote", "host", "disk", [11, 12], keep_source=False)).bytes_freed_src == 2 * BB
    assert mover.execute(move("promote", "disk", "host", [12])).bytes_moved == BB
    assert isinstance(mover.execute(move("restore", "disk", "device", [11])), MoveAcked)
    assert isinstance(mover.execute(move("restore", "host", "device", [12, 10])), MoveAcked)
    for b in (10, 11, 12):
        assert torch.equal(words_of(mover, "device", b), data[b])
    assert mover.disk_tier.has(12) and not mover.disk_tier.has(11)


def test_spill_and_evict_to_disk_then_restore(mover):
    data = commit(mover, "device", [20, 21, 22, 23, 24, 25])
    a = mover.execute(move("spill", "device", "disk", [20, 21]))
    b = mover.execute(move("evict", "device", "disk", [25, 22, 24, 23]))   # more blocks than the ring
    assert (a.bytes_freed_src, b.bytes_freed_src) == (0, 4 * BB)
    assert b.checksum_list() == [psum(x, data[x]) for x in (25, 22, 24, 23)]
    r = mover.execute(move("restore", "disk", "device", [24, 22, 25, 23], keep_source=True))
    assert isinstance(r, MoveAcked) and r.bytes_freed_src == 0 and r.checksum_list() == [b.checksum_list()[i] for i in (2, 1, 0, 3)]
    for x in data:
        assert torch.equal(words_of(mover, "device", x), data[x])
        if x != 20 and x != 21:
            assert mover.disk_tier.has(x)


@pytest.mark.parametrize("mode", ["dma", "staged"])
def test_both_copy_modes_move_the_same_bytes(tmp_path, mover_device, mode):
    # the copy mode follows the DMA issuer: "dma" where DMAs go in batches, "staged" elsewhere
    dma = BatchedTorchDma() if mode == "dma" else TorchDma()
    # pipeline_blocks=2: several chunks, so staged buffers are reused and restores pipeline
    with make_mover(tmp_path, device=mover_device, dma=dma, pipeline_blocks=2) as e:
        assert e.ctx.copy_modes == {"d2h": mode, "h2d": mode}
        # non-consecutive slots on both sides, so DMA runs and staging indices both matter
        data = commit(e, "device", list(range(10)))
        release(e, "device", [1, 4, 7])
        out = e.execute(move("evict", "device", "host", [9, 0, 5, 6, 2]))
        back = e.execute(move("restore", "host", "device", [6, 2, 9, 0, 5]))
        assert back.checksum_list() == [out.checksum_list()[i] for i in (3, 4, 0, 1, 2)]
        for b in (0, 2, 3, 5, 6, 8, 9):
            assert torch.equal(words_of(e, "device", b), data[b])
        e.check_integrity()


def test_moves_run_the_triton_checksum_kernel_under_the_interpreter(tmp_path, monkeypatch):
    """The CPU mover's checksums through Triton's interpreter, not just the torch reference."""
    from residency.kernels import checksum

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(checksum, "block_checksums_ref", _must_not_run)
    with make_mover(tmp_path) as e:
        data = commit(e, "device", [3, 1, 4])
        assert isinstance(e.execute(move("evict", "device", "host", [4, 3])), MoveAcked)
        assert isinstance(e.execute(move("restore", "host", "device", [3, 4])), MoveAcked)
        for b in data:
            assert torch.equal(words_of(e, "device", b), data[b])


def test_a_duplicate_move_id_is_answered_with_the_recorded_outcome_and_moves_nothing(mover):
    commit(mover, "device", [1, 2])
    cmd = move("evict", "device", "host", [1, 2])
    first = mover.execute(cmd)
    after_first = snapshot(mover)
    again = mover.execute(cmd)
    assert again is first
    assert_same(snapshot(mover), after_first)
    # even a different command under the same id gets the recorded outcome, not a second move
    other = move("restore", "host", "device", [1], move_id=cmd.move_id)
    assert mover.execute(other) is first
    assert mover.host_pool.has(1) and not mover.device_pool.has(1)
    assert mover.outcome_of(cmd.move_id) is first


def test_a_rejected_move_id_stays_rejected_when_resubmitted(mover):
    cmd = move("spill", "device", "host", [5])
    rej = mover.execute(cmd)
    assert isinstance(rej, MoveRejected)
    commit(mover, "device", [5])                 # now it could run, but the id already has its outcome
    assert mover.execute(cmd) is rej
    assert not mover.host_pool.has(5)


def test_outcomes_are_reported_for_reconciliation(mover):
    commit(mover, "device", [1])
    a = mover.execute(move("spill", "device", "host", [1], move_id="known"))
    rep = mover.report(["known", "never-seen"])
    assert rep.outcomes == [a] and rep.unknown == ["never-seen"]
    assert mover.outcome_of("never-seen") is None


def test_capacities_and_usage_are_bytes_per_tier(tmp_path):
    with make_mover(tmp_path, device_blocks=6, host_blocks=4, disk_blocks=3) as e:
        assert e.capacities() == {"device": 6 * BB, "host": 4 * BB, "disk": 3 * BB}
        commit(e, "device", [1, 2])
        commit(e, "disk", [7])
        assert e.usage() == {"device": 2 * BB, "host": 0, "disk": BB}


def test_release_reports_the_bytes_the_pool_freed_and_refcounts_hold(mover):
    commit(mover, "device", [1, 2])
    mover.device_pool.incref([2])               # a reader holds block 2
    rel = release(mover, "device", [1, 2])
    assert rel.bytes_freed == BB                 # only block 1's slot came back
    assert mover.device_pool.has(2)
    assert release(mover, "device", [2]).bytes_freed == BB


def _must_not_run(*a, **k):
    raise AssertionError("the torch reference ran where the Triton kernel should have")
