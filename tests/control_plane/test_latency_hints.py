"""What the control process does only for latency: where its loop thread and ZMQ I/O thread run
(``ControlConfig.cpu``), and staying awake for an outcome a worker said is about to come
(``MoveNearlyDone``). Neither may change what is recorded or answered."""
from __future__ import annotations

import os
import time

from events import affinity
from events.commands import AskMove, ExecuteMove, MoveNearlyDone

from tests.control_plane.conftest import check_ledger, commit_blocks, joined, wait_for  # noqa: E402
from tests.control_plane.test_protocol import _setup, _SlowDisk  # noqa: E402


def _pinned_zmq_threads(cpu: int) -> list[str]:
    return [name for name, cpus in affinity.thread_cpus("ZMQbg/IO").items() if cpus == {cpu}]


def test_a_control_placed_on_a_cpu_runs_its_loop_and_its_zmq_thread_there_and_takes_them_away(
        make_control, fake_worker, sqlite_url):
    cpu = max(os.sched_getaffinity(0))
    before = _pinned_zmq_threads(cpu)
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, cpu=cpu)
    assert proc.call(lambda p: os.sched_getaffinity(0)).result(5) == {cpu}
    assert len(_pinned_zmq_threads(cpu)) == len(before) + 1
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None
    proc.stop("done")
    wait_for(lambda: len(_pinned_zmq_threads(cpu)) == len(before), what="its own ZMQ context ended")
    check_ledger(store)


def test_the_placement_plan_leaves_small_hosts_alone_and_names_bad_cpus():
    assert affinity.plan(1, set(range(4))) == (None, [None])
    assert affinity.plan(2, set(range(16))) == (15, [14, 13])
    assert affinity.plan(5, set(range(8))) == (None, [None] * 5)       # four CPUs must stay free


def test_a_nearly_done_hint_keeps_the_loop_awake_until_that_moves_outcome_and_nothing_else_changes(
        make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ack_spin_max_us=2_000_000)
    blocks = commit_blocks(proc, fw, 4)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks[:2]))
    cmd = fw.expect(ExecuteMove)
    fw.send(MoveNearlyDone(move_id="m-nobody", worker=0, bytes_left=1 << 30))     # no such move: ignored
    fw.send(MoveNearlyDone(move_id=cmd.move_id, worker=0, bytes_left=1 << 30))
    wait_for(lambda: proc.health().metrics.get("awake_polls", 0) > 0, what="the loop polls awake")
    assert proc.call(lambda p: sorted(p._awake)).result(5) == [cmd.move_id]
    fw.send(fw.ack(cmd))
    assert fut.result(5).error is None
    assert proc.call(lambda p: dict(p._awake)).result(5) == {}, "the outcome ends the wait at once"
    m = proc.health().metrics
    assert m["nearly_done_hints"] == 2 and m["outcome_terminal"] == 1
    proc.stop("done")
    check_ledger(store)


def test_with_no_spin_allowed_a_hint_is_only_counted(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ack_spin_max_us=0)
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)
    fw.send(MoveNearlyDone(move_id=cmd.move_id, worker=0, bytes_left=1 << 30))
    wait_for(lambda: proc.health().metrics.get("nearly_done_hints", 0) == 1, what="the hint counted")
    time.sleep(0.05)
    assert proc.call(lambda p: dict(p._awake)).result(5) == {}
    fw.send(fw.ack(cmd))
    assert fut.result(5).error is None
    assert proc.health().metrics.get("awake_polls", 0) == 0
    proc.stop("done")
    check_ledger(store)


def _lane_worker(proc, fake_worker, short_dir):
    from events.commands import Hello, LaneHello
    from tests.control_plane.conftest import FakeWorker
    main = fake_worker()
    lane = FakeWorker(f"ipc://{short_dir}/w.sock", identity=b"w0.lane")
    main.send(Hello(worker=0, epoch=main.epoch, device="cpu", tiers=main.tiers, block_bytes=main.block_bytes,
                    lane="w0.lane"))
    lane.send(LaneHello(worker=0, epoch=main.epoch))
    wait_for(lambda: joined(proc), what="worker joined")
    wait_for(lambda: proc.call(lambda p: p._by_worker[0].lane_up).result(5), what="lane up")
    return main, lane


def _commit_on_lane(proc, lane, n):
    from events.commands import AskCommitBlocks, BlocksWritten, CommitBlocks
    fut = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=n))
    cmd = lane.expect(CommitBlocks)
    lane.send(BlocksWritten(request_id=cmd.request_id, worker=0, tier="device", blocks=cmd.blocks,
                            bytes=n * lane.block_bytes, keys=[""] * n))
    assert fut.result(5).error is None
    return cmd.blocks


def test_a_big_copy_is_announced_to_the_lane_before_its_commit_and_its_command_follows_the_commit(
        fake_worker, sqlite_url, short_dir):
    """CommandAhead goes to the lane of a move of at least command_ahead_min_bytes while its
    MoveRequested is still committing (here: a disk held still); the command itself waits for the
    commit (write-ahead). Smaller moves get no hint."""
    import threading

    from control.policy import PolicyConfig
    from control.proc import ControlConfig, ControlProc
    from events.commands import CommandAhead
    from ledger import LedgerStore

    store = LedgerStore.open(sqlite_url, create=True)
    gate = threading.Event()
    gate.set()
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", policy=PolicyConfig(pressure=False, park=False),
                        release_on_stop=False, command_ahead_min_bytes=3 * 4096, command_ahead_us=1500)
    proc = ControlProc(_SlowDisk(store, gate), cfg).start()
    main, lane = _lane_worker(proc, fake_worker, short_dir)
    try:
        blocks = _commit_on_lane(proc, lane, 6)
        gate.clear()                                    # the MoveRequested cannot commit yet
        fut = proc.submit(AskMove(ask_id="big", kind="evict", worker=0, blocks=blocks[:3]))
        hint = lane.expect(CommandAhead)
        assert lane.quiet(0.3) == [], "the command waits for its commit"
        gate.set()
        cmd = lane.expect(ExecuteMove)
        assert (hint.move_id, hint.within_us) == (cmd.move_id, 1500)
        lane.send(lane.ack(cmd))
        assert fut.result(5).error is None
        small = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[3:5]))
        cmd = lane.expect(ExecuteMove)                  # no hint first: 2 blocks < 3
        lane.send(lane.ack(cmd))
        assert small.result(5).error is None
        assert proc.health().metrics["commands_ahead"] == 1
        proc.stop("done")
        check_ledger(store)
    finally:
        gate.set()
        proc.stop()
        lane.close()
        store.close()
