"""The worker process's side of the protocol: its fault hooks, its record of what it did, bad input,
idempotent commands, tombstones, orphan exit. The socket side runs a no-copy mover here (no torch);
the real mover is exercised by the kill, crash and random-fault tests."""
from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.worker import WorkerRecord
from residency.events import catalog as ev
from residency.events.codec import encode_message
from residency.events.commands import (
    BlocksReleased, BlocksWritten, CommandFailed, CommitBlocks, ErrorReply, ExecuteMove, Hello, LaneHello,
    FromWorker, MoveNearlyDone, MovesReport, Ping, Pong, QueryMoves, ReleaseBlocks, Shutdown,
)

from tests.control_plane.conftest import REPO, spawn, worker_argv  # noqa: E402


def test_fault_hooks_are_off_unless_named_and_an_unknown_one_is_an_error():
    assert not WorkerFaults("").enabled
    f = WorkerFaults("drop_ack=0.5,delay_ack=0.1:250,crash_after_moves=3,exec_delay_ms=20,seed=4")
    assert f.enabled and f.p["drop_ack"] == 0.5 and (f.delay_p, f.delay_ms) == (0.1, 250.0)
    assert f.crash_after_moves == 3 and f.exec_delay_ms == 20
    with pytest.raises(ValueError, match="unknown worker fault"):
        WorkerFaults("drop_acks=0.1")


def test_an_id_reported_unknown_becomes_a_tombstone_and_is_never_run():
    rec = WorkerRecord(0)
    rec.running.add("m-running")
    ack = ev.MoveAcked(move_id="m-done", worker=0, bytes_moved=1, bytes_freed_src=1, checksum_ok=True,
                       started_ns=1, finished_ns=2)
    rec.note("m-done", [ack], 5)
    rep = rec.report(["m-done", "m-running", "m-never"])
    assert rep.outcomes == [ack] and rep.unknown == ["m-never"]
    assert "m-never" in rec.tombstones and "m-running" not in rec.tombstones
    refused = rec.refusal(ExecuteMove(move_id="m-never", kind="evict", src="device", dst="host", blocks=[1],
                                      keep_source=False, deadline_ns=0))
    assert type(refused[0]) is ev.MoveRejected and "never executed" in refused[0].reason
    rec.note("m-rel", [BlocksReleased(release_id="m-rel", worker=0, tier="host", blocks=[1], bytes_freed=0)], 9)
    assert rec.outcomes["m-rel"].bytes_freed_src == 0      # the measured 0 is kept, for a later report


class Control:
    """A ROUTER standing in for the control process. ``use_lane``: once the worker's LaneHello came,
    the mover's commands go to its lane (as the control process does); else all to the worker's
    Hello socket (a control that ignores the lane)."""

    _decoder = msgspec.msgpack.Decoder(FromWorker)
    TO_IO_THREAD = (Ping, QueryMoves, Shutdown)

    def __init__(self, endpoint: str, use_lane: bool = False):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.identity = None
        self.use_lane = use_lane
        self.lane = None
        self.senders: dict[type, set[bytes]] = {}

    def recv(self, timeout: float = 30.0):
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError("the worker said nothing")
        identity, data = self.sock.recv_multipart()
        msg = self._decoder.decode(data)
        self.senders.setdefault(type(msg), set()).add(identity)
        if type(msg) is LaneHello:
            self.lane = identity
        elif identity != self.lane:
            self.identity = identity
        return msg

    def expect(self, t, timeout: float = 10.0, skip: tuple = ()):
        """The next ``t``; before it only Hello, Pong, LaneHello (and the types in ``skip``)."""
        while True:
            m = self.recv(timeout)
            if type(m) is t:
                return m
            assert type(m) in (Hello, Pong, LaneHello, *skip), m

    def send(self, msg) -> None:
        to_lane = self.use_lane and type(msg) not in self.TO_IO_THREAD
        if to_lane:
            while self.lane is None:
                self.expect(LaneHello)
        self.sock.send_multipart([self.lane if to_lane else self.identity, encode_message(msg)])

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.identity, *frames])


LANE_MODES = pytest.mark.parametrize("mode", ["lane", "lane ignored"])


def _spawn_for(mode: str, argv: list[str], log_path: Path):
    return spawn(argv, log_path)


@LANE_MODES
def test_a_worker_answers_bad_input_by_name_runs_commands_once_and_honours_tombstones(short_dir, tmp_path, mode):
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=mode == "lane")
    w = _spawn_for(mode, worker_argv(0, endpoint, short_dir, mover="nocopy"), tmp_path / "worker.log")
    try:
        hello = ctl.expect(Hello)
        assert (hello.worker, hello.block_bytes) == (0, 16384) and ctl.identity == b"w0"
        assert hello.lane == "w0.lane"
        for frames, name in (((b"\x00garbage",), "malformed_message"), ((b"\x92\xa5Bogus\x01",), "unknown_message_type"),
                             ((encode_message(Pong(worker=0, nonce=1, ts_ns=1)),), "unexpected_message"),
                             ((b"a", b"b"), "malformed_message")):
            ctl.send_raw(*frames)
            assert ctl.expect(ErrorReply).error == name
        if mode == "lane":        # bad input on the lane is answered from the lane
            while ctl.lane is None:
                ctl.expect(LaneHello)
            ctl.senders.pop(ErrorReply)
            ctl.sock.send_multipart([ctl.lane, b"\x00garbage"])
            assert ctl.expect(ErrorReply).error == "malformed_message" and ctl.senders[ErrorReply] == {b"w0.lane"}
        ctl.send(Ping(nonce=42, ts_ns=1))
        assert ctl.expect(Pong).nonce == 42
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=[1, 2], seed=0))
        assert ctl.expect(BlocksWritten).blocks == [1, 2]
        cmd = ExecuteMove(move_id="m-1", kind="evict", src="device", dst="host", blocks=[1], keep_source=False,
                          deadline_ns=0)
        ctl.send(cmd)
        first = ctl.expect(ev.MoveAcked)
        ctl.send(cmd)                                    # the same command again: the same answer, nothing run
        assert ctl.expect(ev.MoveAcked) == first
        ctl.send(QueryMoves(move_ids=["m-1", "m-2"]))
        rep = ctl.expect(MovesReport)
        assert rep.outcomes == [first] and rep.unknown == ["m-2"]
        ctl.send(ExecuteMove(move_id="m-2", kind="evict", src="device", dst="host", blocks=[2], keep_source=False,
                             deadline_ns=0))
        assert ctl.expect(ev.MoveRejected).reason.startswith("reported unknown")       # tombstoned: never run
        ctl.send(ReleaseBlocks(release_id="m-3", tier="device", blocks=[9]))
        failed = ctl.expect(CommandFailed)
        assert failed.ref == "m-3" and "not resident" in failed.detail
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
        # the mover's replies came back the way its commands went; everything else from the I/O thread
        engine_side = {b"w0.lane"} if mode == "lane" else {b"w0"}
        assert ctl.senders[ev.MoveAcked] == ctl.senders[BlocksWritten] == ctl.senders[CommandFailed] == engine_side
        assert ctl.senders[Pong] == ctl.senders[MovesReport] == ctl.senders[Hello] == {b"w0"}
        assert LaneHello in ctl.senders
    finally:
        w.kill()
        ctl.sock.close(0)


def test_the_benches_worker_asked_for_timings_follows_each_outcome_with_its_marks_in_order(short_dir, tmp_path):
    """bench/worker.py --report-timings: a MoveTimed after each move's outcome on the lane, its
    marks in the order they happened."""
    from residency.events.commands import MoveTimed
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=True)
    w = spawn(worker_argv(0, endpoint, short_dir, mover="nocopy") + ["--report-timings"], tmp_path / "worker.log")
    try:
        ctl.expect(Hello)
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=[1, 2], seed=0))
        ctl.expect(BlocksWritten)
        t0 = time.time_ns()
        ctl.send(ExecuteMove(move_id="m-1", kind="evict", src="device", dst="host", blocks=[1, 2], keep_source=False,
                             deadline_ns=0))
        ack = ctl.expect(ev.MoveAcked)
        timed = ctl.expect(MoveTimed)
        marks = [t0, timed.received_ns, timed.queued_ns, timed.engine_start_ns, ack.started_ns, ack.finished_ns,
                 timed.engine_end_ns, timed.sent_ns, time.time_ns()]
        assert timed.move_id == "m-1" and timed.ahead_ns == 0 and marks == sorted(marks), marks
        assert ctl.senders[MoveTimed] == {b"w0.lane"}
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
    finally:
        w.kill()
        ctl.sock.close(0)


def test_a_worker_whose_control_never_comes_back_says_hello_again_then_exits(short_dir, tmp_path):
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint)
    argv = worker_argv(0, endpoint, short_dir, mover="nocopy")
    argv[argv.index("--orphan-exit-s") + 1] = "1.5"
    w = spawn(argv + ["--control-silent-s", "0.3"], tmp_path / "worker.log")
    try:
        hellos = [ctl.expect(Hello)]
        t0 = time.monotonic()
        hellos.append(ctl.expect(Hello, timeout=3))       # control silent: Hello again
        assert w.wait(10) == 0 and time.monotonic() - t0 < 5
        assert hellos[0].epoch == hellos[1].epoch
        assert "control_gone" in (tmp_path / "worker.log").read_text()
    finally:
        w.kill()
        ctl.sock.close(0)


def _real_lane_worker(short_dir, tmp_path, extra: list[str], blocks: int):
    """A worker with a real mover whose lane is up, ``blocks`` blocks committed on its device."""
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=True)
    w = spawn(worker_argv(0, endpoint, short_dir, device_blocks=256) + extra, tmp_path / "worker.log")
    try:
        ctl.expect(Hello, timeout=60)
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=list(range(blocks)), seed=3))
        ctl.expect(BlocksWritten)
    except BaseException:
        w.kill()
        ctl.sock.close(0)
        raise
    return ctl, w


def test_a_lane_worker_says_nearly_done_before_a_big_moves_ack(short_dir, tmp_path):
    """A real mover on the lane: a move of several pipeline chunks (64 blocks each) is preceded by
    MoveNearlyDone with its last chunk's bytes; a move of one chunk is not."""
    ctl, w = _real_lane_worker(short_dir, tmp_path, [], blocks=200)
    try:
        ctl.send(ExecuteMove(move_id="m-big", kind="evict", src="device", dst="host", blocks=list(range(100)),
                             keep_source=False, deadline_ns=0))
        got = []
        while not got or type(got[-1]) is not ev.MoveAcked:
            got.append(ctl.recv())
        got = [m for m in got if type(m) not in (Pong, Hello, LaneHello)]
        assert [type(m) for m in got] == [MoveNearlyDone, ev.MoveAcked]
        assert got[0].move_id == "m-big" and got[0].bytes_left == (100 - 64) * 16384
        assert ctl.senders[MoveNearlyDone] == {b"w0.lane"}
        ctl.send(ExecuteMove(move_id="m-small", kind="evict", src="device", dst="host", blocks=[150, 151],
                             keep_source=False, deadline_ns=0))
        assert ctl.expect(ev.MoveAcked).move_id == "m-small"
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
    finally:
        w.kill()
        ctl.sock.close(0)


@LANE_MODES
def test_a_command_ahead_is_a_silent_hint_on_either_socket(short_dir, tmp_path, mode):
    """CommandAhead is never answered (neither by the lane, which polls awake for the command,
    nor by the I/O thread, which ignores it) and the command that follows runs as usual."""
    from residency.events.commands import CommandAhead
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=mode == "lane")
    w = _spawn_for(mode, worker_argv(0, endpoint, short_dir, mover="nocopy"), tmp_path / "worker.log")
    try:
        ctl.expect(Hello)
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=[1, 2], seed=0))
        ctl.expect(BlocksWritten)
        for i, blocks in enumerate(([1], [2])):
            ctl.send(CommandAhead(move_id=f"m-{i}", within_us=1_000_000 if i == 0 else 1000))
            time.sleep(0.05)
            ctl.send(ExecuteMove(move_id=f"m-{i}", kind="evict", src="device", dst="host", blocks=blocks,
                                 keep_source=False, deadline_ns=0))
            assert ctl.expect(ev.MoveAcked).move_id == f"m-{i}"     # expect: nothing but Pong/Hello/LaneHello before
        ctl.send(Ping(nonce=7, ts_ns=1))
        assert ctl.expect(Pong).nonce == 7
        assert ErrorReply not in ctl.senders
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
    finally:
        w.kill()
        ctl.sock.close(0)


def test_no_pickle_crosses_any_socket():
    """Sockets carry msgspec structs only: no pickle, no send_pyobj/recv_pyobj anywhere we ship."""
    pattern = re.compile(r"^\s*(import|from)\s+c?pickle\b|\bc?pickle\.(loads?|dumps?|Unpickler)\b|send_pyobj|recv_pyobj")
    offenders = []
    for pkg in ("control", "dataplane", "events", "ledger"):
        for path in (REPO / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, offenders


class _Link:
    """A lane stand-in: what was sent, decoded."""

    def __init__(self):
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def send_bytes(self, payload: bytes) -> None:
        from residency.events.codec import decode_message
        self.sent.append(decode_message(payload))


class _SettlingMover:
    """A mover that has a move's outcome (``on_outcome``), then settles it before returning."""

    on_outcome = None

    def __init__(self, link: _Link):
        self.link, self.sent_before_return = link, None

    def execute(self, cmd: ExecuteMove):
        ack = ev.MoveAcked(move_id=cmd.move_id, worker=0, bytes_moved=1, bytes_freed_src=1, checksum_ok=True,
                           started_ns=1, finished_ns=2)
        self.on_outcome(ack)
        self.sent_before_return = list(self.link.sent)      # the mover's bookkeeping would run here
        return ack


@pytest.mark.parametrize("faults", ["", "duplicate_ack=1", "drop_ack=1"])
def test_a_moves_outcome_leaves_before_the_mover_settles_it_once_and_through_the_fault_hooks(faults):
    """The device thread sends a move's outcome the moment the mover has it, before the mover's
    bookkeeping after it; the rest of the command's replies do not send it again; and the reply
    fault hooks act on that one path (twice with duplicate_ack, never with drop_ack)."""
    from residency.dataplane.device_thread import DeviceThread
    from residency.dataplane.outbox import Outbox
    from residency.dataplane.worker import WorkerCore
    link = _Link()
    mover = _SettlingMover(link)
    f, rec = WorkerFaults(faults), WorkerRecord(0)
    dev = DeviceThread(core=WorkerCore(mover, 0, f), record=rec, faults=f, ctx=zmq.Context.instance(),
                       endpoint="inproc://unused", worker=0, epoch=1, hand_back=lambda *a: None)
    cmd = ExecuteMove(move_id="m-1", kind="evict", src="device", dst="host", blocks=[1], keep_source=False,
                      deadline_ns=0)
    dev.on_command(Outbox(link, rec, f), cmd)
    acks = [m for m in link.sent if type(m) is ev.MoveAcked]
    assert len(acks) == {"": 1, "duplicate_ack=1": 2, "drop_ack=1": 0}[faults], link.sent
    assert mover.sent_before_return == link.sent, "the ack went after the mover returned"
    assert rec.report(["m-1"]).outcomes[0].move_id == "m-1"        # recorded, whatever the hooks did to it
    assert mover.on_outcome is None


def test_a_lane_worker_sends_a_moves_ack_once_and_the_same_ack_again_for_a_repeated_command(short_dir, tmp_path):
    """A real mover on the lane: a move's ack is sent once, a repeated command gets the same ack
    again, QueryMoves reports it, and a restore of those blocks verifies what the move wrote."""
    ctl, w = _real_lane_worker(short_dir, tmp_path, [], blocks=100)
    try:
        cmd = ExecuteMove(move_id="m-1", kind="evict", src="device", dst="host", blocks=list(range(100)),
                          keep_source=False, deadline_ns=0)
        ctl.send(cmd)
        ack = ctl.expect(ev.MoveAcked, skip=(MoveNearlyDone,))
        assert ack.move_id == "m-1" and ack.bytes_moved == 100 * 16384 and len(ack.checksums) == 8 * 100
        ctl.send(cmd)                                    # the same command again: the same answer
        assert ctl.expect(ev.MoveAcked) == ack
        ctl.send(QueryMoves(move_ids=["m-1"]))
        assert ctl.expect(MovesReport).outcomes == [ack]
        ctl.send(ExecuteMove(move_id="m-2", kind="restore", src="host", dst="device", blocks=list(range(100)),
                             keep_source=False, deadline_ns=0))
        back = ctl.expect(ev.MoveAcked, skip=(MoveNearlyDone,))
        assert back.move_id == "m-2" and back.checksums == ack.checksums
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
        acks = []
        while ctl.sock.poll(100):
            m = ctl.recv()
            acks += [m] if type(m) is ev.MoveAcked else []
        assert acks == []                                # nothing sent twice
    finally:
        w.kill()
        ctl.sock.close(0)
