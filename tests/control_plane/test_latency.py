"""What the control process does for latency, against scripted workers: where a move's time goes
(traces), the engine lane, an ack committed and answered before its fold, the hints
(``MoveNearlyDone``, ``CommandAhead``). None of it may change what is recorded or answered."""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from residency.events import catalog as ev
from residency.events.commands import ErrorReply, ExecuteMove, Hello, Ping
from residency.events.asks import AskMove
from residency.ledger import LedgerStore

from tests.control_plane.conftest import (  # noqa: E402
    SlowDisk as _SlowDisk, check_ledger, commit_blocks, events_of, gated_control, joined, setup_control as _setup,
    wait_for,
)


def _lane_worker(proc, fake_worker, short_dir):
    from residency.events.commands import Hello, LaneHello
    from tests.control_plane.conftest import FakeWorker
    main = fake_worker()
    lane = FakeWorker(f"ipc://{short_dir}/w.sock", identity=b"w0.lane")
    main.send(Hello(worker=0, epoch=main.epoch, device="cpu", tiers=main.tiers, block_bytes=main.block_bytes,
                    lane="w0.lane"))
    lane.send(LaneHello(worker=0, epoch=main.epoch))
    wait_for(lambda: joined(proc), what="worker joined")
    wait_for(lambda: proc.call(lambda p: p.workers.by_worker[0].lane_up).result(5), what="lane up")
    return main, lane


@contextlib.contextmanager
def _lane_control(sqlite_url, short_dir, fake_worker, **over):
    """A gated control (``gated_control`` with ``over``) and a scripted worker with a lane, joined:
    yields (proc, store, gate, lane); everything stopped and closed after."""
    proc, store, gate = gated_control(sqlite_url, short_dir, **over)
    try:
        main, lane = _lane_worker(proc, fake_worker, short_dir)
        try:
            yield proc, store, gate, lane
        finally:
            lane.close()
    finally:
        gate.set()
        proc.stop()
        store.close()


def _commit_on_lane(proc, lane, n):
    from residency.events.commands import BlocksWritten, CommitBlocks
    from residency.events.asks import AskCommitBlocks
    fut = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=n))
    cmd = lane.expect(CommitBlocks)
    lane.send(BlocksWritten(request_id=cmd.request_id, worker=0, tier="device", blocks=cmd.blocks,
                            bytes=n * lane.block_bytes, keys=[""] * n))
    assert fut.result(5).error is None
    return cmd.blocks


def test_while_the_host_is_kept_awake_an_ask_does_not_wake_the_lane_first(fake_worker, sqlite_url, short_dir):
    """With keep_awake's spinners spinning (a window open, here lingering 30 s after a big move) a
    woken thread runs at once: a big ask's first CommandAhead is its move's hint, with no wake-up
    (move_id "") before it. Once the window is over, the wake-up comes first again."""
    from residency.events.commands import CommandAhead

    with _lane_control(sqlite_url, short_dir, fake_worker, command_ahead_min_bytes=3 * 4096, keep_awake=True,
                       keep_awake_min_bytes=3 * 4096, keep_awake_linger_s=30.0) as (proc, store, gate, lane):
        blocks = _commit_on_lane(proc, lane, 6)

        def big(ask_id: str, first: list[int]) -> list[str]:
            fut = proc.submit(AskMove(ask_id=ask_id, kind="evict" if ask_id != "b" else "restore", worker=0,
                                      blocks=first))
            seen = []
            while True:
                msg = lane.recv(5)
                assert type(msg) in (CommandAhead, ExecuteMove), msg
                seen.append(msg.move_id if type(msg) is CommandAhead else "command")
                if type(msg) is ExecuteMove:
                    lane.send(lane.ack(msg))
                    assert fut.result(5).error is None
                    return seen
        first = big("a", blocks[:3])
        assert first[0] == "" and first[1] != "" and first[2] == "command", "asleep host: the lane woken first"
        assert proc.call(lambda p: p.keep_awake.spinners.awake_until > time.monotonic_ns()).result(5)
        second = big("b", blocks[:3])
        assert "" not in second and second[-1] == "command", "spinners spinning: no wake-up"
        proc.call(lambda p: p.keep_awake.spinners.end_at(0)).result(5)
        third = big("c", blocks[:3])
        assert third[0] == "", "the window over: the lane is woken first again"
        assert proc.health().metrics["lanes_woken"] == 2
        proc.stop("done")
        check_ledger(store)


def test_a_big_copy_is_announced_to_the_lane_before_its_commit_and_its_command_follows_the_commit(
        fake_worker, sqlite_url, short_dir):
    """An ask naming at least command_ahead_min_bytes wakes the lane (a CommandAhead without a
    command) before it is resolved; its move's CommandAhead, carrying the command, goes while the
    MoveRequested is still committing (here: a disk held still); the command itself waits for the
    commit (write-ahead). Smaller moves get neither."""
    from residency.events.commands import CommandAhead

    with _lane_control(sqlite_url, short_dir, fake_worker, command_ahead_min_bytes=3 * 4096,
                       command_ahead_us=1500) as (proc, store, gate, lane):
        blocks = _commit_on_lane(proc, lane, 6)
        gate.clear()                                    # the MoveRequested cannot commit yet
        fut = proc.submit(AskMove(ask_id="big", kind="evict", worker=0, blocks=blocks[:3]))
        wake = lane.expect(CommandAhead)                # the ask came: the lane is woken first
        hint = lane.expect(CommandAhead)                # the move decided: its command rides along
        assert (wake.move_id, wake.command) == ("", None)
        assert lane.quiet(0.3) == [], "the command waits for its commit"
        gate.set()
        cmd = lane.expect(ExecuteMove)
        assert (hint.move_id, hint.within_us, hint.command) == (cmd.move_id, 1500, cmd)
        lane.send(lane.ack(cmd))
        assert fut.result(5).error is None
        small = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[3:5]))
        cmd = lane.expect(ExecuteMove)                  # no hint first: 2 blocks < 3
        lane.send(lane.ack(cmd))
        assert small.result(5).error is None
        m = proc.health().metrics
        assert m["commands_ahead"] == 1 and m["commands_sent_ahead"] == 1 and m["lanes_woken"] == 1
        proc.stop("done")
        check_ledger(store)


# ---------------------------------------------------------------------- where a move's time goes
def test_when_the_tick_runs_every_outcome_is_committed_and_every_answer_that_can_go_has_gone(
        make_control, fake_worker, sqlite_url):
    """A checkpoint's hash or a policy's scan never sits between an outcome and its answer."""
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, checkpoint_every_events=1,
                             checkpoint_every_s=0.0)
    seen: list[tuple[int, int]] = []

    def spy(p):
        tick = p._tick

        def watched():
            seen.append((p.recorder.num_buffered, p.answers.num_due(p.recorder.committed)))
            tick()
        p._tick = watched
    proc.call(spy).result(5)
    blocks = commit_blocks(proc, fw, 4)
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        assert fut.result(5).error is None
    assert seen and all(s == (0, 0) for s in seen), [s for s in seen if s != (0, 0)][:5]
    proc.stop("done")
    check_ledger(store)


def test_a_checkpoint_due_by_time_waits_for_an_iteration_that_sent_and_answered_nothing(
        make_control, fake_worker, sqlite_url):
    """Its hash would stand between a command and the worker starting it, or an answer and its
    in-process asker; it waits for a quiet iteration (one period at most)."""
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, checkpoint_every_s=0.02)
    seen: list[tuple[bool, bool]] = []

    def spy(p):
        take = p.checkpoints.take

        def watched(now):
            overdue = now - p.checkpoints.last_at >= 2 * int(p.cfg.checkpoint_every_s * 1e9)
            seen.append((p._acted, overdue))
            take(now)
        p.checkpoints.take = watched
    proc.call(spy).result(5)
    blocks = commit_blocks(proc, fw, 8)
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b]))
        cmd = fw.expect(ExecuteMove)
        time.sleep(0.025)       # a move longer than the period: its ack finds a checkpoint due
        fw.send(fw.ack(cmd))
        assert fut.result(5).error is None
    wait_for(lambda: len(seen) >= 3, what="checkpoints")
    proc.stop("done")
    assert all(not acted or overdue for acted, overdue in seen), seen
    assert any(not acted for acted, _ in seen)
    check_ledger(store)


def test_a_traced_move_keeps_its_phases_in_order_with_the_workers_own(make_control, fake_worker, sqlite_url):
    from residency.events.commands import MoveTimed
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, trace_moves=2)
    blocks = commit_blocks(proc, fw, 3)
    mids = []
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b]))
        cmd = fw.expect(ExecuteMove)
        t = time.time_ns()
        fw.send(fw.ack(cmd))
        fw.send(MoveTimed(move_id=cmd.move_id, worker=0, received_ns=t - 5, queued_ns=t - 4, engine_start_ns=t - 3,
                          engine_end_ns=t - 2, sent_ns=t - 1))
        assert fut.result(5).error is None
        mids.append(cmd.move_id)
    traces = wait_for(lambda: (lambda d: d if "w_sent" in d.get(mids[-1], {}) else None)(
        proc.call(lambda p: {m: dict(v) for m, v in p.traces.by_move.items()}).result(5)), what="the worker's marks")
    assert list(traces) == mids[1:]                                    # the last trace_moves moves only
    marks = traces[mids[-1]]
    order = ["asked", "requested", "committed", "sent", "received", "decoded", "recorded", "answered"]
    assert [marks[k] for k in order] == sorted(marks[k] for k in order), marks
    assert marks["w_sent"] - marks["w_received"] == 4


def test_tracing_is_off_unless_configured_and_a_workers_timings_are_then_ignored(make_control, fake_worker,
                                                                                 sqlite_url):
    from residency.events.commands import MoveTimed
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    (b,) = commit_blocks(proc, fw, 1)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=[b]))
    cmd = fw.expect(ExecuteMove)
    fw.send(fw.ack(cmd))
    fw.send(MoveTimed(move_id=cmd.move_id, worker=0, received_ns=1, queued_ns=2, engine_start_ns=3,
                      engine_end_ns=4, sent_ns=5))
    assert fut.result(5).error is None
    fw.quiet(0.1)
    assert proc.call(lambda p: (p.traces.by_move, p.metrics["handler_failed"])).result(5) == ({}, 0)


# ---------------------------------------------------------------------- the engine lane
@pytest.mark.parametrize("lane_first", [False, True], ids=["hello-first", "lane-hello-first"])
def test_the_engines_commands_wait_for_the_lane_then_go_there_and_its_acks_count(make_control, fake_worker,
                                                                                 sqlite_url, short_dir, lane_first):
    """A worker that names an engine lane in its Hello gets the engine's commands on the lane, not
    before the lane's LaneHello (whichever of the two arrives first), in the order they were asked;
    Pings and QueryMoves stay on its Hello socket; what comes back on the lane is the worker's."""
    from residency.events.commands import BlocksWritten, CommitBlocks, LaneHello, Pong
    from tests.control_plane.conftest import FakeWorker
    proc, store = make_control(sqlite_url, ping_interval_s=0.05)
    main = fake_worker()
    lane = FakeWorker(f"ipc://{short_dir}/w.sock", identity=b"w0.lane")
    try:
        def say_lane_hello():
            lane.send(LaneHello(worker=0, epoch=main.epoch))
        if lane_first:
            say_lane_hello()
            time.sleep(0.2)
        main.send(Hello(worker=0, epoch=main.epoch, device="cpu", tiers=main.tiers, block_bytes=main.block_bytes,
                        lane="w0.lane"))
        wait_for(lambda: joined(proc), what="worker joined")
        from residency.events.asks import AskCommitBlocks
        fut = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=4))
        if not lane_first:
            assert lane.quiet(0.3) == [] and main.quiet(0.1) == []   # held: the lane is not known up yet
            say_lane_hello()
        cmd = lane.expect(CommitBlocks)
        lane.send(BlocksWritten(request_id=cmd.request_id, worker=0, tier="device", blocks=cmd.blocks,
                                bytes=4 * main.block_bytes, keys=[""] * 4))
        assert fut.result(5).error is None
        futs = [proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b])) for i, b in
                enumerate(cmd.blocks[:2])]
        got = [lane.expect(ExecuteMove), lane.expect(ExecuteMove)]
        assert [c.blocks for c in got] == [cmd.blocks[:1], cmd.blocks[1:2]]
        for c in got:
            lane.send(lane.ack(c))
        assert all(f.result(5).error is None for f in futs)
        # the I/O thread's messages: Pings keep coming to the Hello socket, none to the lane
        main.answer_pings = False
        ping = main.sock.poll(2000)
        assert ping and type(main._decoder.decode(main.sock.recv())) is Ping
        assert [m for m in lane.quiet(0.2) if type(m) is Ping] == []
        main.send(Pong(worker=0, nonce=1, ts_ns=1))
        proc.stop("done")
        state = check_ledger(store)
        assert state.tier(0, "host").used_bytes == 2 * main.block_bytes
    finally:
        lane.close()


def test_a_lane_of_a_worker_that_never_said_hello_is_not_taken_for_it(make_control, fake_worker, sqlite_url,
                                                                     short_dir):
    """An outcome from a lane nobody announced is refused like any unknown sender's; a LaneHello of
    another incarnation does not open the lane of this one."""
    from residency.events.commands import LaneHello
    from tests.control_plane.conftest import FakeWorker
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)     # a worker without a lane
    lane = FakeWorker(f"ipc://{short_dir}/w.sock", identity=b"w0.lane")
    try:
        blocks = commit_blocks(proc, fw, 2)
        fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks[:1]))
        cmd = fw.expect(ExecuteMove)                                   # no lane named: the Hello socket
        lane.send(LaneHello(worker=0, epoch=fw.epoch + 1))
        lane.send(lane.ack(cmd))
        err = lane.expect(ErrorReply)
        assert err.error == "unknown_worker"
        assert not fut.done()
        fw.send(fw.ack(cmd))
        assert fut.result(5).error is None
        proc.stop("done")
        assert len(events_of(store, ev.MoveAcked)) == 1
        check_ledger(store)
    finally:
        lane.close()


def test_an_ack_is_committed_and_answered_before_its_fold_yet_nothing_else_sees_it_unfolded(make_control, fake_worker,
                                                                                          sqlite_url):
    """The short way of an ack (MoveDispatcher.settle): durable, then the asker's answer, then the
    fold, all before the next message; listeners (the scheduler, reports) hear it folded."""
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 4)
    heard = []
    futs = []

    def listener(seq, e):
        if type(e) is ev.MoveAcked:
            with LedgerStore.open(sqlite_url) as reader:
                durable = any(r.seq == seq for r in reader.read(seq))
            heard.append((e.move_id in proc.state.inflight, proc.moves.busy.by_worker[0] & set(blocks[:2]),
                          futs[0].done(), durable))

    proc.call(lambda p: p.add_listener(listener)).result(5)
    futs.append(proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks[:2])))
    cmd = fw.expect(ExecuteMove)
    fw.send(fw.ack(cmd))
    assert futs[0].result(5).error is None
    wait_for(lambda: heard, what="the listener heard the ack")
    in_flight, busy, answered, durable = heard[0]
    assert not in_flight and answered and durable        # folded when heard; answered and committed before
    assert busy == set(blocks[:2])                      # the blocks are freed for others after the fold
    assert proc.call(lambda p: p.moves.busy.by_worker[0] & set(blocks[:2])).result(5) == set()
    proc.stop("done")
    state = check_ledger(store)
    assert state.tier(0, "host").used_bytes == 2 * fw.block_bytes


def test_an_asker_on_the_loop_thread_hears_of_an_ack_only_after_its_fold(make_control, fake_worker, sqlite_url):
    """The serving path asks from the loop thread and reads the state in its future's callback:
    that answer waits for the fold (only askers off the loop's thread hear before it)."""
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 4)
    seen = []

    def ask_on_loop(p):
        f = p.submit(AskMove(ask_id="loop", kind="evict", worker=0, blocks=blocks[:2]))
        f.add_done_callback(lambda f: seen.append((any(b in p.moves.busy.by_worker.get(0, ()) for b in blocks[:2]),
                                                   [m for m in p.state.inflight])))
        return f

    inner = proc.call(ask_on_loop).result(5)
    cmd = fw.expect(ExecuteMove)
    fw.send(fw.ack(cmd))
    assert inner.result(5).error is None
    assert seen == [(False, [])]             # folded (nothing in flight) and its blocks free, when heard
    proc.stop("done")
    check_ledger(store)


def test_the_loop_steps_off_the_gil_after_answering_a_thread_of_its_process_not_a_socket(make_control, fake_worker,
                                                                                        sqlite_url, short_dir):
    from residency.control.transport import AskClient
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, answer_yield_min_blocks=4)
    blocks = commit_blocks(proc, fw, 12)
    fut = proc.submit(AskMove(ask_id="thread", kind="evict", worker=0, blocks=blocks[:4]))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None
    assert proc.health().metrics["answer_yields"] == 1
    fut = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[4:7]))   # a fold quicker than a yield
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None
    assert proc.health().metrics["answer_yields"] == 1
    client = AskClient(f"ipc://{short_dir}/c.sock", timeout_s=5)
    with ThreadPoolExecutor(1) as pool:          # the operator's CLI: an answer over its socket
        ans = pool.submit(client.ask, AskMove(ask_id="cli", kind="evict", worker=0, blocks=blocks[8:12]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        assert ans.result(10).error is None
    assert proc.health().metrics["answer_yields"] == 1
    proc.stop("done")
    check_ledger(store)


def test_a_lane_that_never_says_lane_hello_is_given_up_and_the_commands_go_to_the_hello_socket(
        make_control, fake_worker, sqlite_url):
    from residency.events.commands import CommitBlocks, Hello as H, BlocksWritten
    proc, store = make_control(sqlite_url, ping_interval_s=0.05, lane_wait_s=0.3)
    fw = fake_worker()
    fw.send(H(worker=0, epoch=fw.epoch, device="cpu", tiers=fw.tiers, block_bytes=fw.block_bytes, lane="w0.lane"))
    wait_for(lambda: joined(proc), what="worker joined")
    from residency.events.asks import AskCommitBlocks
    fut = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=2))
    t0 = time.monotonic()
    cmd = fw.expect(CommitBlocks, timeout=5)              # held, then sent here once the lane is given up
    assert time.monotonic() - t0 >= 0.2
    fw.send(BlocksWritten(request_id=cmd.request_id, worker=0, tier="device", blocks=cmd.blocks,
                          bytes=2 * fw.block_bytes, keys=["", ""]))
    assert fut.result(5).error is None
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=cmd.blocks))
    fw.send(fw.ack(fw.expect(ExecuteMove)))               # and so is every later command
    assert fut.result(5).error is None
    assert proc.health().metrics["lanes_given_up"] == 1
    proc.stop("done")
    check_ledger(store)


class _CountingDisk(_SlowDisk):
    """The ledger store, counting its appends (commits)."""

    def __init__(self, store):
        super().__init__(store, threading.Event())
        self.gate.set()
        self.appends = 0

    def append(self, items, **kw):
        self.appends += 1
        return self._store.append(items, **kw)


def test_a_burst_of_acks_is_committed_together_and_only_a_lone_moves_ack_takes_the_short_way(
        fake_worker, sqlite_url, short_dir):
    """With many moves in flight their acks come in bursts: committed a few at a time at the end of
    the loop's iterations (a commit and a GIL yield per ack would halve the moves/s the loop
    sustains), while the ack of the only move in flight is committed and answered at once."""
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
    store = LedgerStore.open(sqlite_url, create=True)
    disk = _CountingDisk(store)
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", release_on_stop=False,
                        policy=PolicyConfig(pressure=False, park=False), trace_moves=64)
    proc = ControlProc(disk, cfg).start()
    try:
        fw = fake_worker()
        fw.hello()
        wait_for(lambda: joined(proc), what="worker joined")
        blocks = commit_blocks(proc, fw, 41)
        short_way = lambda mids: proc.call(lambda p: [m for m in mids if "folded" in p.traces.by_move.get(m, {})]).result(5)  # noqa: E731
        futs = [proc.submit(AskMove(ask_id=f"a{b}", kind="evict", worker=0, blocks=[b])) for b in blocks[:40]]
        cmds = [fw.expect(ExecuteMove) for _ in futs]
        before = disk.appends
        for c in cmds:                                  # one burst
            fw.send(fw.ack(c))
        assert all(f.result(5).error is None for f in futs)
        assert disk.appends - before <= 10, disk.appends - before
        assert len(short_way([c.move_id for c in cmds])) <= 1          # at most the last, alone by then
        fut = proc.submit(AskMove(ask_id="lone", kind="evict", worker=0, blocks=blocks[40:]))
        cmd = fw.expect(ExecuteMove)
        fw.send(fw.ack(cmd))
        assert fut.result(5).error is None
        assert short_way([cmd.move_id]) == [cmd.move_id]
        proc.stop("done")
        check_ledger(store)
    finally:
        proc.stop()
        store.close()
