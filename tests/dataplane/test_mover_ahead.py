"""An early start (a CommandAhead that carried its command): the copies begin before the command
comes, nothing is visible until it does, and a start whose command never comes is undone exactly."""
import torch

from residency.dataplane.worker import WorkerCore
from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import assert_same, commit, make_mover, move, snapshot, words_of


def visible(mover):
    """What anyone but the move itself can see: which blocks are ready where, their bytes and
    checksums. (A begun move holds reserved slots, counted in ``usage`` as any move's in flight;
    the worker reports usage only in an Inventory, and that command drops an early start first.)"""
    snap = snapshot(mover)
    for k in ("device", "host", "usage"):
        snap.pop(k)
    return snap


def test_a_move_begun_ahead_is_invisible_until_waited_for_then_acks_as_a_plain_move(tmp_path, mover_device):
    twin = make_mover(tmp_path / "a", device=mover_device)
    ahead = make_mover(tmp_path / "b", device=mover_device)
    try:
        for e in (twin, ahead):
            data = commit(e, "device", [4, 9, 2, 7], seed=77)
        plain = twin.execute(move("evict", "device", "host", [9, 2, 7], move_id="m-plain"))
        cmd = move("evict", "device", "host", [9, 2, 7], move_id="m-ahead")
        before = visible(ahead)
        assert ahead.begin_ahead(cmd)
        assert_same(visible(ahead), before)               # nothing published, nothing freed
        assert ahead.outcome_of("m-ahead") is None
        assert ahead.report(["m-ahead"]).unknown == []    # in flight here (the worker's record says unknown)
        ack = ahead.wait("m-ahead")
        assert isinstance(ack, MoveAcked), ack
        assert ack.checksum_list() == plain.checksum_list()
        assert (ack.bytes_moved, ack.bytes_freed_src) == (plain.bytes_moved, plain.bytes_freed_src)
        for b in (9, 2, 7):
            assert torch.equal(words_of(ahead, "host", b), data[b])
            assert not ahead.device_pool.has(b)
        assert ahead.usage() == twin.usage()
        back = ahead.begin_ahead(move("restore", "host", "device", [7, 9], move_id="m-back"))
        assert back and isinstance(ahead.wait("m-back"), MoveAcked)
        for b in (7, 9):
            assert torch.equal(words_of(ahead, "device", b), data[b])
        ahead.check_integrity()
    finally:
        twin.close()
        ahead.close()


def test_an_abandoned_early_start_leaves_the_pools_exactly_as_before_and_the_command_still_runs(mover):
    commit(mover, "device", [1, 2, 3, 5])
    commit(mover, "host", [8])
    before = snapshot(mover)                           # slot tables and reservations included
    cmd = move("evict", "device", "host", [3, 1, 5])
    assert mover.begin_ahead(cmd)
    mover.abandon(cmd.move_id, "test")
    assert_same(snapshot(mover), before)
    assert mover.outcome_of(cmd.move_id) is None       # nothing recorded: the command runs as new
    assert isinstance(mover.execute(cmd), MoveAcked)
    mover.abandon("m-never-begun", "test")             # a no-op


def test_only_device_host_moves_that_would_not_be_refused_begin_ahead_and_a_refusal_is_not_recorded(mover):
    commit(mover, "device", [1, 2])
    assert not mover.begin_ahead(move("evict", "device", "disk", [1]))         # writes files: waits
    unknown = move("evict", "device", "host", [1, 99])
    assert not mover.begin_ahead(unknown)
    assert mover.outcome_of(unknown.move_id) is None
    assert mover.execute(unknown).__class__.__name__ == "MoveRejected"        # the command answers
    done = move("spill", "device", "host", [2])
    mover.execute(done)
    assert not mover.begin_ahead(done)                                          # a known id never again
    first = move("spill", "device", "host", [1])
    assert mover.begin_ahead(first)
    assert not mover.begin_ahead(move("evict", "device", "host", [1]))          # busy in the first
    mover.abandon(first.move_id, "test")


def test_the_worker_core_finishes_its_early_start_only_for_the_same_command_and_drops_it_for_any_other(tmp_path):
    mover = make_mover(tmp_path / "d")
    core = WorkerCore(mover, 0)
    try:
        commit(mover, "device", [1, 2, 3, 4])
        a = move("evict", "device", "host", [1, 2], move_id="m-a")
        assert core.start_ahead(a) and core.ahead == a and core.ahead_ns > 0
        assert not core.start_ahead(move("evict", "device", "host", [3], move_id="m-b"))   # one at a time
        other = move("spill", "device", "host", [3], move_id="m-c")
        assert isinstance(core.run(other)[0], MoveAcked)                # another command first: a dropped
        assert core.ahead is None and mover.outcome_of("m-a") is None
        assert mover.host_pool.has(3) and not mover.host_pool.has(1) and mover.device_pool.has(1)
        assert core.start_ahead(a)
        changed = move("evict", "device", "host", [1, 4], move_id="m-a")      # same id, other blocks
        ack = core.run(changed)[0]
        assert isinstance(ack, MoveAcked) and mover.device_pool.has(2) and not mover.device_pool.has(4)
        b = move("evict", "device", "host", [2], move_id="m-d")
        assert core.start_ahead(b)
        ack = core.run(b)[0]
        assert isinstance(ack, MoveAcked) and ack.move_id == "m-d" and not mover.device_pool.has(2)
        assert core.ahead is None
        assert not core.start_ahead(b)                                   # done: a second hint begins nothing
        core.drop_ahead("nothing to drop")
        mover.check_integrity()
    finally:
        mover.close()


def test_a_corrupted_host_copy_fails_an_early_restore_naming_the_block_and_leaves_the_pools(mover):
    commit(mover, "device", [3, 6])
    mover.execute(move("evict", "device", "host", [3, 6]))
    mover.host_pool.words[mover.host_pool.slot_of(6)][5] ^= 1 << 9
    before = snapshot(mover)
    cmd = move("restore", "host", "device", [3, 6])
    assert mover.begin_ahead(cmd)
    out = mover.wait(cmd.move_id)
    assert isinstance(out, MoveFailed) and "6" in out.error, out
    assert_same(snapshot(mover), before)
