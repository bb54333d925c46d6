"""The control process against a scripted worker: write-ahead, idempotent acks, deadlines, late
acks, silent and zero releases, loss, bad input, back-pressure, live == replay."""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from control.moves import MoveConfig
from events import catalog as ev
from events.codec import encode_message
from events.commands import (
    AskMove, AskReleaseBlocks, AskSetBudget, AskStatus, BlocksReleased, ErrorReply, ExecuteMove, Hello, MovesReport,
    Ping, QueryMoves, ReleaseBlocks, Shutdown,
)
from ledger import LedgerStore

from tests.control_plane.conftest import check_ledger, commit_blocks, events_of, joined, wait_for  # noqa: E402


def _setup(make_control, fake_worker, url, **over):
    proc, store = make_control(url, **over)
    fw = fake_worker()
    fw.hello()
    wait_for(lambda: joined(proc), what="worker joined")
    return proc, store, fw


def _types(store):
    return [type(r.event).__name__ for r in store.read()]


# ---------------------------------------------------------------------- the round trip
@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_write_ahead_the_move_is_committed_before_the_worker_sees_the_command(fake_worker, any_url, short_dir,
                                                                              inline):
    from control.policy import PolicyConfig
    from control.proc import ControlConfig, ControlProc
    store = LedgerStore.open(any_url, create=True)
    gate = threading.Event()
    gate.set()
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", commit_inline=inline, release_on_stop=False,
                        policy=PolicyConfig(pressure=False, park=False))
    proc = ControlProc(_SlowDisk(store, gate), cfg).start()
    try:
        fw = fake_worker()
        fw.hello()
        wait_for(lambda: joined(proc), what="worker joined")
        blocks = commit_blocks(proc, fw, 4)
        gate.clear()                                   # the disk stalls: MoveRequested cannot commit
        fut = proc.submit(AskMove(ask_id="a1", kind="evict", worker=0, blocks=blocks[:2]))
        assert fw.quiet(0.5) == []                     # so the command must not leave
        gate.set()
        cmd = fw.expect(ExecuteMove)
        with LedgerStore.open(any_url) as reader:      # now it is committed, readable by anyone
            req = [r.event for r in reader.read() if type(r.event) is ev.MoveRequested]
        assert [r.move_id for r in req] == [cmd.move_id]
        assert (req[0].kind, req[0].src, req[0].dst, req[0].blocks, req[0].keep_source) == (
            "evict", "device", "host", blocks[:2], False)
        assert req[0].deadline_ns > time.time_ns()
        # the worker measured something else than the plan: the ledger takes the measurement
        fw.send(fw.ack(cmd, bytes_moved=7777, bytes_freed_src=6666))
        ans = fut.result(5)
        assert ans.error is None and [type(e).__name__ for e in ans.events] == ["MoveAcked"]
        acked = events_of(store, ev.MoveAcked)[0]
        assert acked.seq == ans.seqs[0] and (acked.event.bytes_moved, acked.event.bytes_freed_src) == (7777, 6666)
        proc.stop("done")
        state = check_ledger(store)
        assert state.tier(0, "device").reclaimed_bytes == 6666
    finally:
        gate.set()
        proc.stop()
        store.close()


def test_a_duplicated_ack_is_recorded_once(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskMove(ask_id="a", kind="spill", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)
    ack = fw.ack(cmd)
    fw.send(ack)
    fw.send(ack)
    fut.result(5)
    fw.send(ack)
    time.sleep(0.2)
    assert proc.call(lambda p: p.metrics["outcome_duplicate"]).result(5) == 2
    assert _types(store).count("MoveAcked") == 1
    check_ledger(store)


def test_reordered_acks_each_settle_their_own_move(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 3)
    futs = [proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b])) for i, b in enumerate(blocks)]
    cmds = [fw.expect(ExecuteMove) for _ in blocks]
    for cmd in reversed(cmds):
        fw.send(fw.ack(cmd))
    answers = [f.result(5) for f in futs]
    assert [a.move_ids[0] for a in answers] == [c.move_id for c in cmds]
    state = check_ledger(store)
    assert state.tier(0, "host").used_bytes == 3 * fw.block_bytes


def test_a_dropped_ack_strands_the_move_and_a_requery_brings_it_back_as_a_late_ack(make_control, fake_worker,
                                                                                     sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, deadline_s=0.3, requery_interval_s=0.2)
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)                         # executed; the ack is "dropped": never sent
    ans = fut.result(5)
    assert [type(e).__name__ for e in ans.events] == ["MoveStranded"]
    assert ans.events[0].why == "deadline" and ans.events[0].bytes_at_risk == 2 * fw.block_bytes
    state = check_ledger(store)
    assert state.tier(0, "device").stranded_bytes == 2 * fw.block_bytes and cmd.move_id in state.stranded
    q = fw.expect(QueryMoves, timeout=3)                 # the watchdog asks again
    assert q.move_ids == [cmd.move_id]
    fw.send(MovesReport(worker=0, outcomes=[fw.ack(cmd)], unknown=[]))
    wait_for(lambda: events_of(store, ev.MoveLateAcked), what="late ack")
    state = check_ledger(store)
    assert state.stranded_bytes_total() == 0 and state.tier(0, "host").used_bytes == 2 * fw.block_bytes


def test_a_delayed_ack_after_the_deadline_re_accounts_the_stranded_bytes(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, deadline_s=0.2, requery_interval_s=60)
    blocks = commit_blocks(proc, fw, 1)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)
    assert type(fut.result(5).events[0]) is ev.MoveStranded
    fw.send(fw.ack(cmd))                                 # late
    wait_for(lambda: events_of(store, ev.MoveLateAcked), what="late ack")
    fw.send(fw.ack(cmd))                                 # and once more: nothing more to record
    time.sleep(0.2)
    assert _types(store).count("MoveLateAcked") == 1
    state = check_ledger(store)
    assert state.outcomes[cmd.move_id] == "MoveLateAcked" and state.stranded_bytes_total() == 0


def test_a_release_that_never_answers_is_stranded_not_zero(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, deadline_s=0.3, requery_interval_s=60)
    blocks = commit_blocks(proc, fw, 3)
    fut = proc.submit(AskReleaseBlocks(ask_id="r", worker=0, tier="device", blocks=blocks))
    cmd = fw.expect(ReleaseBlocks)
    ans = fut.result(5)                                  # the worker says nothing
    assert [type(e).__name__ for e in ans.events] == ["MoveStranded"]
    assert ans.events[0].why == "silent_release" and ans.events[0].bytes_at_risk == 3 * fw.block_bytes
    state = check_ledger(store)
    assert state.tier(0, "device").stranded_bytes == 3 * fw.block_bytes
    assert state.tier(0, "device").reclaimed_bytes == 0           # silence is not "0 freed"
    assert not events_of(store, ev.BlocksFreed)
    # the answer comes after all: re-accounted, and what was freed is what the worker measured
    fw.send(BlocksReleased(release_id=cmd.release_id, worker=0, tier="device", blocks=blocks,
                           bytes_freed=3 * fw.block_bytes))
    wait_for(lambda: events_of(store, ev.BlocksFreed), what="late release")
    state = check_ledger(store)
    assert state.stranded_bytes_total() == 0 and state.tier(0, "device").used_bytes == 0
    assert state.tier(0, "device").reclaimed_bytes == 3 * fw.block_bytes


def test_a_release_answered_with_zero_is_an_accounting(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskReleaseBlocks(ask_id="r", worker=0, tier="device", blocks=blocks, reason="finished"))
    cmd = fw.expect(ReleaseBlocks)
    fw.send(BlocksReleased(release_id=cmd.release_id, worker=0, tier="device", blocks=blocks, bytes_freed=0))
    ans = fut.result(5)
    assert [type(e).__name__ for e in ans.events] == ["MoveAcked", "BlocksFreed"]
    assert ans.events[1].bytes == 0
    state = check_ledger(store)
    assert state.tier(0, "device").stranded_bytes == 0 and state.tier(0, "device").reclaimed_bytes == 0
    assert state.tier(0, "device").used_bytes == 0       # the copies are gone; 0 bytes were reported freed


def test_a_refused_ask_is_answered_with_the_arithmetic_and_nothing_is_sent(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 4, tier="host")
    bb = fw.block_bytes
    assert proc.submit(AskSetBudget(ask_id="b", worker=0, tier="device", floor_bytes=62 * bb,
                                    ceiling_bytes=0)).result(5).error is None
    ans = proc.submit(AskMove(ask_id="r", kind="restore", worker=0, blocks=blocks)).result(5)
    (refused,) = ans.events
    assert type(refused) is ev.MoveRefused and ans.move_ids == []
    assert (refused.asked_bytes, refused.available_bytes, refused.floor_bytes) == (4 * bb, 2 * bb, 62 * bb)
    assert fw.quiet(0.3) == []                           # no command left the control process
    assert "MoveRequested" not in _types(store)


# ---------------------------------------------------------------------- bad input
def test_garbage_on_the_socket_is_answered_by_name_and_the_control_keeps_serving(make_control, fake_worker,
                                                                                  sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    cases = [
        ([b"\xff\xfe garbage"], "malformed_message"),
        ([encode_message(Ping(nonce=1, ts_ns=1))[:3]], "malformed_message"),
        ([b"\x92\xa9NoSuchMsg\x01"], "unknown_message_type"),
        ([encode_message(Shutdown(reason="a command, not a reply"))], "unexpected_message"),
        ([encode_message(Ping(nonce=1, ts_ns=1)), b"extra frame"], "malformed_message"),
        ([b"\x81\xa1a\x01"], "malformed_message"),
    ]
    for frames, name in cases:
        fw.send_frames(frames)
        err = fw.expect(ErrorReply)
        assert err.error == name, (frames, err)
    # still serving
    blocks = commit_blocks(proc, fw, 1)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None
    assert proc.health().healthy and proc.fatal is None
    check_ledger(store)


def test_raw_garbage_on_a_tcp_endpoint_never_crashes_the_control_process(make_control, fake_worker, sqlite_url):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    proc, store = make_control(sqlite_url, worker_endpoint=endpoint)
    rng = __import__("random").Random(7)
    for payload in (b"GET / HTTP/1.0\r\n\r\n", bytes(range(256)) * 64, bytes(rng.getrandbits(8) for _ in range(5000)),
                    b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03" * 64):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
            time.sleep(0.05)
    from tests.control_plane.conftest import FakeWorker
    fw = FakeWorker(endpoint)
    try:
        fw.hello()
        wait_for(lambda: joined(proc), what="join over tcp")
        blocks = commit_blocks(proc, fw, 1)
        fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        assert fut.result(5).error is None
    finally:
        fw.close()
    assert proc.fatal is None and proc.health().healthy
    check_ledger(store)


def test_a_message_from_an_unknown_worker_id_is_refused_by_name(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, expected_workers=[0])
    intruder = fake_worker(worker=0, identity=b"intruder")
    intruder.send(ev.MoveAcked(move_id="m-x", worker=0, bytes_moved=1, bytes_freed_src=1, checksum_ok=True,
                               started_ns=1, finished_ns=2))
    assert intruder.expect(ErrorReply).error == "unknown_worker"
    stranger = fake_worker(worker=7)
    stranger.hello()
    assert stranger.expect(ErrorReply).error == "unknown_worker"          # worker 7 is not expected here
    liar = fake_worker(worker=0, identity=b"w3")
    liar.hello()
    assert liar.expect(ErrorReply).error == "worker_mismatch"             # identity w3 says it is worker 0
    fw.send(ev.MoveFailed(move_id="m-y", worker=5, error="not mine"))
    assert fw.expect(ErrorReply).error == "worker_mismatch"
    time.sleep(0.1)
    assert sorted(proc.call(lambda p: list(p._by_worker)).result(5)) == [0]
    assert _types(store) == ["ServerStarted", "WorkerJoined"]


# ---------------------------------------------------------------------- loss
def test_a_silent_worker_is_missed_then_lost_with_its_blocks_and_moves_named(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ping_interval_s=0.05, heartbeat_missed_s=0.3,
                             worker_lost_s=0.8)
    blocks = commit_blocks(proc, fw, 3)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks[:1]))
    fw.expect(ExecuteMove)
    fw.answer_pings = False                              # the worker goes silent mid-move
    ans = fut.result(5)
    assert [type(e).__name__ for e in ans.events] == ["MoveStranded"] and ans.events[0].why == "worker_lost"
    missed = events_of(store, ev.WorkerHeartbeatMissed)
    lost = events_of(store, ev.WorkerLost)
    assert len(missed) == 1 and len(lost) == 1 and missed[0].seq < lost[0].seq
    assert lost[0].event.blocks_lost == blocks and lost[0].event.bytes_lost == 3 * fw.block_bytes
    state = check_ledger(store)
    assert not state.workers[0].alive and state.stranded_bytes_total() == 4 * fw.block_bytes
    # it was only slow: it comes back, and is told it was written off
    fw.answer_pings = True
    fw.hello()
    got = fw.quiet(0.5)
    assert any(type(m) is ErrorReply and m.error == "worker_lost" for m in got)
    assert any(type(m) is Shutdown for m in got)


def test_worker_process_exit_is_a_loss_right_away(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    commit_blocks(proc, fw, 2)
    proc.worker_exited(0, fw.epoch, -9)
    wait_for(lambda: events_of(store, ev.WorkerLost), what="loss")
    assert events_of(store, ev.WorkerLost)[0].event.reason == "worker process exited with code -9"
    proc.worker_exited(0, 12345, -9)                     # an older incarnation's exit: nothing more
    time.sleep(0.1)
    assert len(events_of(store, ev.WorkerLost)) == 1


# ---------------------------------------------------------------------- recovery with a scripted worker
def _crashed_ledger(url, epoch=1):
    """A ledger as a crashed control process leaves it: three moves in flight, no ServerStopped."""
    from events.envelope import Envelope
    store = LedgerStore.open(url, create=True)
    bb = 4096
    evs = [ev.ServerStarted(version="0", config_digest="x"),
           ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 64 * bb, "host": 128 * bb, "disk": 256 * bb},
                           block_bytes=bb),
           ev.BlocksCommitted(worker=0, session="s", tier="device", blocks=[1, 2, 3], keys=["", "", ""], bytes=3 * bb)]
    for mid, blk in (("m-old-1", 1), ("m-old-2", 2), ("m-old-3", 3)):
        evs.append(ev.MoveRequested(move_id=mid, kind="evict", worker=0, src="device", dst="host", blocks=[blk],
                                    bytes_planned=bb, keep_source=False, deadline_ns=time.time_ns() + 10**12,
                                    reason="t"))
    items = []
    for i, e in enumerate(evs, 1):
        cause = f"hello:w0@{epoch}" if type(e) is ev.WorkerJoined else None
        items.append((Envelope(producer="control", epoch=7, producer_seq=i, ts_ns=time.time_ns(), causation=cause), e))
    store.append(items)
    store.close()


def test_after_a_crash_the_same_worker_is_adopted_and_asked_what_it_completed(make_control, fake_worker, sqlite_url):
    _crashed_ledger(sqlite_url, epoch=1)
    proc, store = make_control(sqlite_url, adopt_grace_s=5, ping_interval_s=0.05)
    fw = fake_worker(epoch=1)
    # the new control pings the identity the ledger names; our Pong is answered "unknown_worker";
    # a real worker then says Hello again (dataplane.proc does exactly this)
    assert fw.expect(ErrorReply, timeout=3).error == "unknown_worker"
    fw.hello()
    q = fw.expect(QueryMoves)
    assert sorted(q.move_ids) == ["m-old-1", "m-old-2", "m-old-3"]
    cmd1 = ExecuteMove(move_id="m-old-1", kind="evict", src="device", dst="host", blocks=[1], keep_source=False,
                       deadline_ns=0)
    fw.send(MovesReport(worker=0, outcomes=[fw.ack(cmd1)], unknown=["m-old-2"]))   # m-old-3 still running
    wait_for(lambda: len(events_of(store, ev.MoveAcked, ev.MoveAbandoned)) == 2, what="reconciled")
    assert not events_of(store, ev.WorkerJoined)[1:]     # adopted: no second join
    cmd3 = ExecuteMove(move_id="m-old-3", kind="evict", src="device", dst="host", blocks=[3], keep_source=False,
                       deadline_ns=0)
    fw.send(fw.ack(cmd3))
    wait_for(lambda: len(events_of(store, ev.MoveAcked)) == 2, what="the running one")
    state = check_ledger(store)
    assert state.outcomes == {"m-old-1": "MoveAcked", "m-old-2": "MoveAbandoned", "m-old-3": "MoveAcked"}


def test_after_a_crash_a_worker_that_does_not_come_back_is_lost_with_its_moves(make_control, sqlite_url):
    _crashed_ledger(sqlite_url, epoch=1)
    proc, store = make_control(sqlite_url, adopt_grace_s=0.3, expected_workers=[0])
    wait_for(lambda: events_of(store, ev.WorkerLost), what="loss after the grace")
    state = check_ledger(store)
    assert {state.outcomes[m] for m in ("m-old-1", "m-old-2", "m-old-3")} == {"MoveStranded"}
    assert proc.call(lambda p: p.missing_workers()).result(5) == [0]      # the supervisor starts a new one


def test_after_a_crash_another_incarnation_replaces_the_one_the_ledger_knew(make_control, fake_worker, sqlite_url):
    _crashed_ledger(sqlite_url, epoch=1)
    proc, store = make_control(sqlite_url, adopt_grace_s=5)
    fw = fake_worker(epoch=2)
    fw.hello()
    wait_for(lambda: len(events_of(store, ev.WorkerJoined)) == 2, what="rejoin")
    types = _types(store)
    assert types.index("WorkerLost") < len(types) - 1 - types[::-1].index("WorkerJoined")
    state = check_ledger(store)
    assert state.workers[0].alive and not state.blocks.get(0) and state.stranded_bytes_total() > 0


# ---------------------------------------------------------------------- health and back-pressure
class _SlowDisk:
    """The ledger store, except that appends wait while ``gate`` is closed (a stalled disk)."""

    def __init__(self, store, gate: threading.Event):
        self._store, self.gate = store, gate

    def append(self, items, **kw):
        self.gate.wait()
        return self._store.append(items, **kw)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_a_stalled_ledger_is_never_behind_a_green_health_check(fake_worker, sqlite_url, short_dir, inline):
    from control.policy import PolicyConfig
    from control.proc import ControlConfig, ControlProc
    store = LedgerStore.open(sqlite_url, create=True)
    gate = threading.Event()
    gate.set()
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", stall_after_s=0.3, max_queue=2,
                        commit_inline=inline, policy=PolicyConfig(pressure=False, park=False),
                        release_on_stop=False)
    proc = ControlProc(_SlowDisk(store, gate), cfg).start()
    try:
        fw = fake_worker()
        fw.hello()
        wait_for(lambda: joined(proc), what="join")
        assert proc.health().healthy
        gate.clear()                                   # the disk stalls
        steps = [ev.StepCompleted(worker=0, step=i, batch_digest="", num_seqs=1, num_tokens=1, duration_ns=1)
                 for i in range(6)]
        proc.call(lambda p: [p.record(e) for e in steps])
        time.sleep(0.8)
        h = proc.health()                              # asked from another thread, while the loop is stuck
        assert not h.healthy, h
        assert any("stalled" in p for p in h.problems) and any("lagging" in p for p in h.problems), h.problems
        gate.set()
        wait_for(lambda: proc.health().healthy, timeout=5, what="health back")
        if not inline:   # the writer's queue filled: a metric (and the writer's ledger_backpressure log line)
            assert proc.health().metrics["ledger_backpressure_waits"] >= 1
        proc.stop("done")
        assert [type(r.event).__name__ for r in store.read()].count("StepCompleted") == 6   # nothing dropped
    finally:
        gate.set()
        proc.stop()
        store.close()


def test_live_state_hash_equals_replay_at_every_checkpoint(make_control, fake_worker, any_url):
    proc, store, fw = _setup(make_control, fake_worker, any_url, checkpoint_every_events=5)
    blocks = commit_blocks(proc, fw, 6)
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="spill" if i % 2 else "evict", worker=0, blocks=[b]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        fut.result(5)
    st = proc.submit(AskStatus()).result(5)
    proc.stop("checkpoint test")
    from tests.control_plane.conftest import check_checkpoints
    assert check_checkpoints(store) >= 3
    state = check_ledger(store)
    from control.fold import fold_all
    from control.state import State
    upto = fold_all(State(), store.read(1, st.last_seq))
    assert upto.state_hash() == st.state_hash                          # status's live hash == replay
    assert state.state_hash() == proc.state.state_hash()


def test_a_stranded_move_holds_its_destination_room_until_its_worker_answers_for_it(make_control, fake_worker,
                                                                                      sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, deadline_s=0.2, requery_interval_s=60)
    bb = fw.block_bytes
    blocks = commit_blocks(proc, fw, 100, tier="host")          # the device holds 64 blocks
    fut = proc.submit(AskMove(ask_id="r1", kind="restore", worker=0, blocks=blocks[:50]))
    cmd = fw.expect(ExecuteMove)
    assert type(fut.result(5).events[0]) is ev.MoveStranded     # no answer: its 50 blocks may still land
    ans = proc.submit(AskMove(ask_id="r2", kind="restore", worker=0, blocks=blocks[50:80])).result(5)
    (refused,) = ans.events
    assert type(refused) is ev.MoveRefused and refused.available_bytes == 14 * bb
    assert f"held for stranded moves {50 * bb}" in refused.reason
    # the worker answers: it refused to start it (its deadline had passed): the room is free again
    fw.send(ev.MoveRejected(move_id=cmd.move_id, worker=0, reason="deadline: passed before the move could start",
                            asked_bytes=50 * bb))
    wait_for(lambda: proc.call(lambda p: cmd.move_id in p.answered_stranded).result(5), what="answered")
    fut = proc.submit(AskMove(ask_id="r3", kind="restore", worker=0, blocks=blocks[50:80]))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert type(fut.result(5).events[0]) is ev.MoveAcked
    state = check_ledger(store)
    assert cmd.move_id in state.stranded        # the ledger has no event for "never landed": still listed


def test_past_its_deadline_the_workers_own_refusal_is_awaited_before_stranding(make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, deadline_s=0.2, deadline_grace_s=1.0)
    blocks = commit_blocks(proc, fw, 1)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)
    time.sleep(0.5)                                   # past the deadline, inside the grace
    fw.send(ev.MoveRejected(move_id=cmd.move_id, worker=0, reason="deadline: passed before the move could start",
                            asked_bytes=fw.block_bytes))
    assert [type(e).__name__ for e in fut.result(5).events] == ["MoveRejected"]
    assert "MoveStranded" not in _types(store)
    check_ledger(store)


def test_another_writer_on_the_ledger_stops_the_control_process_and_turns_health_red(make_control, fake_worker,
                                                                                     sqlite_url):
    from control.proc import LedgerDiverged
    from events.envelope import Envelope
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    with LedgerStore.open(sqlite_url) as other:
        other.append([(Envelope(producer="intruder", epoch=1, producer_seq=1, ts_ns=time.time_ns()),
                       ev.ServerStopped(reason="not the single writer"))])
    proc.submit(AskSetBudget(ask_id="b", worker=0, tier="device", floor_bytes=0, ceiling_bytes=0))
    wait_for(lambda: not proc.running, what="the control loop to stop")
    assert isinstance(proc.fatal, LedgerDiverged)
    h = proc.health()
    assert not h.healthy and any("control loop failed" in p for p in h.problems)


def test_a_restart_resumes_from_the_newest_snapshot_to_the_same_state(make_control, fake_worker, sqlite_url):
    from control.fold import fold_all
    from control.recovery import replay
    from control.state import State
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, checkpoint_every_events=4, snapshot_every_events=4)
    blocks = commit_blocks(proc, fw, 6)
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        fut.result(5)
    proc.stop("snapshot test")
    rec = replay(store)
    assert rec.from_snapshot > 0 and rec.num_replayed < rec.last_seq
    full = fold_all(State(), store.read())
    assert rec.state.state_hash() == full.state_hash() and rec.state.last_seq == full.last_seq
    assert replay(store, use_snapshot=False).state.state_hash() == full.state_hash()


def test_a_plugged_in_handler_that_raises_is_logged_and_the_loop_goes_on(make_control, fake_worker, sqlite_url):
    from events.commands import Pong
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ping_interval_s=0.05)

    def broken(link, msg):
        raise RuntimeError("a bug in someone's handler")

    proc.call(lambda p: p.on_worker_message(Pong, broken)).result(5)
    fw.quiet(0.3)                                       # pongs go out, each one raises in the handler
    assert proc.running and proc.call(lambda p: p.metrics["handler_failed"]).result(5) >= 1
    blocks = commit_blocks(proc, fw, 1)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None


def test_pressure_spills_through_the_loop_down_to_the_low_watermark(make_control, fake_worker, sqlite_url):
    from control.policy import PolicyConfig
    policy = PolicyConfig(high_watermark=0.8, low_watermark=0.5, hot_s=0.0, cooldown_s=60, park=False)
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, policy=policy, policy_interval_s=0.05)
    commit_blocks(proc, fw, 60)                          # 60 of 64 device blocks: above 0.8
    cmd = fw.expect(ExecuteMove, timeout=5)
    assert (cmd.kind, cmd.src, cmd.dst, cmd.keep_source) == ("evict", "device", "host", False)
    assert len(cmd.blocks) == 60 - 32                    # down to 0.5 x 64 = 32
    fw.send(fw.ack(cmd))
    assert fw.quiet(0.4) == []                           # at the low watermark: nothing more
    req = events_of(store, ev.MoveRequested)[0].event
    assert req.reason.startswith("pressure: device") and events_of(store, ev.MoveRequested)[0].envelope.causation == "policy:pressure"
    state = check_ledger(store)
    assert state.tier(0, "device").used_bytes == 32 * fw.block_bytes


class _FailingDisk(_SlowDisk):
    """Appends fail once ``broken`` is set (the database went away)."""

    def __init__(self, store):
        super().__init__(store, threading.Event())
        self.gate.set()
        self.broken = False

    def append(self, items, **kw):
        if self.broken:
            from ledger.errors import LedgerUnavailable
            raise LedgerUnavailable("cannot reach the ledger database (test)")
        return self._store.append(items, **kw)


@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_a_move_whose_request_cannot_be_committed_is_never_sent(fake_worker, sqlite_url, short_dir, inline):
    from control.policy import PolicyConfig
    from control.proc import ControlConfig, ControlProc
    from ledger.errors import LedgerUnavailable
    store = LedgerStore.open(sqlite_url, create=True)
    disk = _FailingDisk(store)
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", commit_inline=inline, release_on_stop=False,
                        policy=PolicyConfig(pressure=False, park=False))
    proc = ControlProc(disk, cfg).start()
    try:
        fw = fake_worker()
        fw.hello()
        wait_for(lambda: joined(proc), what="worker joined")
        blocks = commit_blocks(proc, fw, 2)
        disk.broken = True
        proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
        wait_for(lambda: not proc.running, what="the control loop to stop")
        assert isinstance(proc.fatal, LedgerUnavailable)
        assert [m for m in fw.quiet(0.3) if type(m) is ExecuteMove] == []      # write-ahead held
        assert not proc.health().healthy
        assert "MoveRequested" not in _types(store)
    finally:
        proc.stop()
        store.close()


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
            rec = p._recorder
            seen.append((len(rec._buffer), sum(1 for need, _ in p._answers if need <= rec.committed)))
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
        checkpoint = p._checkpoint

        def watched(now):
            overdue = now - p._last_ckpt[1] >= 2 * int(p.cfg.checkpoint_every_s * 1e9)
            seen.append((p._acted, overdue))
            checkpoint(now)
        p._checkpoint = watched
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
    from events.commands import MoveTimed
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
    from events.commands import MoveTimed
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
    from events.commands import BlocksWritten, CommitBlocks, LaneHello, Pong
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
        from events.commands import AskCommitBlocks
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
    from events.commands import LaneHello
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
    """The short way of an ack (MoveLifecycle._settle): durable, then the asker's answer, then the
    fold, all before the next message; listeners (the scheduler, reports) hear it folded."""
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 4)
    heard = []
    futs = []

    def listener(seq, e):
        if type(e) is ev.MoveAcked:
            with LedgerStore.open(sqlite_url) as reader:
                durable = any(r.seq == seq for r in reader.read(seq))
            heard.append((e.move_id in proc.state.inflight, proc.busy.by_worker[0] & set(blocks[:2]),
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
    assert proc.call(lambda p: p.busy.by_worker[0] & set(blocks[:2])).result(5) == set()
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
        f.add_done_callback(lambda f: seen.append((any(b in p.busy.by_worker.get(0, ()) for b in blocks[:2]),
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
    from control.transport import AskClient
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 4)
    fut = proc.submit(AskMove(ask_id="thread", kind="evict", worker=0, blocks=blocks[:1]))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert fut.result(5).error is None
    assert proc.health().metrics["answer_yields"] == 1
    client = AskClient(f"ipc://{short_dir}/c.sock", timeout_s=5)
    with ThreadPoolExecutor(1) as pool:          # the operator's CLI: an answer over its socket
        ans = pool.submit(client.ask, AskMove(ask_id="cli", kind="evict", worker=0, blocks=blocks[1:2]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        assert ans.result(10).error is None
    assert proc.health().metrics["answer_yields"] == 1
    proc.stop("done")
    check_ledger(store)


def test_a_lane_that_never_says_lane_hello_is_given_up_and_the_commands_go_to_the_hello_socket(
        make_control, fake_worker, sqlite_url):
    from events.commands import CommitBlocks, Hello as H, BlocksWritten
    proc, store = make_control(sqlite_url, ping_interval_s=0.05, lane_wait_s=0.3)
    fw = fake_worker()
    fw.send(H(worker=0, epoch=fw.epoch, device="cpu", tiers=fw.tiers, block_bytes=fw.block_bytes, lane="w0.lane"))
    wait_for(lambda: joined(proc), what="worker joined")
    from events.commands import AskCommitBlocks
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


def test_a_ledger_that_fails_committing_an_ack_stops_the_control_and_nothing_is_answered(fake_worker, sqlite_url,
                                                                                        short_dir):
    """The ack's commit runs inside its message handler (the short way): a ledger error there must
    end the loop like any failed commit, never be logged as one handler's bug while the loop goes on
    with events folded that were never committed."""
    from control.policy import PolicyConfig
    from control.proc import ControlConfig, ControlProc
    from ledger.errors import LedgerUnavailable
    store = LedgerStore.open(sqlite_url, create=True)
    disk = _FailingDisk(store)
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", release_on_stop=False,
                        policy=PolicyConfig(pressure=False, park=False))
    proc = ControlProc(disk, cfg).start()
    try:
        fw = fake_worker()
        fw.hello()
        wait_for(lambda: joined(proc), what="worker joined")
        blocks = commit_blocks(proc, fw, 2)
        fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
        cmd = fw.expect(ExecuteMove)
        disk.broken = True
        fw.send(fw.ack(cmd))
        wait_for(lambda: proc.fatal is not None, what="the control loop stopped on the ledger error")
        assert isinstance(proc.fatal, LedgerUnavailable)
        assert proc.metrics["handler_failed"] == 0          # it ended the loop, not one message
        assert not fut.done() or fut.result().error is not None
        assert not events_of(store, ev.MoveAcked)
    finally:
        proc.stop()
        store.close()
