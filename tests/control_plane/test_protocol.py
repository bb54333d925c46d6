"""The control process against a scripted worker: write-ahead, idempotent acks, deadlines, late
acks, silent and zero releases, bad input, loss, recovery."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from residency.events import catalog as ev
from residency.events.codec import encode_message
from residency.events.commands import (
    BlocksReleased, ClaimDisk, ErrorReply, ExecuteMove, MovesReport, Ping, QueryMoves, ReleaseBlocks,
    Shutdown,
)
from residency.events.asks import AskMove, AskReleaseBlocks, AskSetBudget
from residency.control.state import check_integrity
from residency.ledger import LedgerStore

from tests.control_plane.conftest import (  # noqa: E402
    SlowDisk as _SlowDisk, check_ledger, commit_blocks, event_types as _types, events_of, joined,
    setup_control as _setup, wait_for,
)


# ---------------------------------------------------------------------- the round trip
@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_write_ahead_the_move_is_committed_before_the_worker_sees_the_command(fake_worker, any_url, short_dir,
                                                                              inline):
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
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
    assert not events_of(store, ev.CopiesReleased)
    # the answer comes after all: re-accounted, and what was freed is what the worker measured
    fw.send(BlocksReleased(release_id=cmd.release_id, worker=0, tier="device", blocks=blocks,
                           bytes_freed=3 * fw.block_bytes))
    wait_for(lambda: events_of(store, ev.CopiesReleased), what="late release")
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
    assert [type(e).__name__ for e in ans.events] == ["CopiesReleased"]
    assert ans.events[0].bytes == 0 and ans.events[0].move_id == cmd.release_id
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
    assert sorted(proc.call(lambda p: list(p.workers.by_worker)).result(5)) == [0]
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
    # each byte once: the stranded move's block is among the three the loss took
    assert not state.workers[0].alive and state.stranded_bytes_total() == 3 * fw.block_bytes
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


def test_a_worker_that_exits_holding_disk_copies_waits_for_its_replacement_which_keeps_what_it_found(
        make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, keep_disk=True, expected_workers=[0])
    on_disk = commit_blocks(proc, fw, 3, tier="disk")
    on_device = commit_blocks(proc, fw, 1)
    proc.worker_exited(0, fw.epoch, -9)
    wait_for(lambda: proc.call(lambda p: p.missing_workers()).result(5) == [0], what="the supervisor's cue")
    assert not events_of(store, ev.WorkerLost)          # not yet: the next incarnation says what survived
    fw.close()
    fw2 = fake_worker(epoch=fw.epoch + 1)
    fw2.hello(disk_blocks=[on_disk[0], on_disk[2], 999])     # on_disk[1]'s file failed its check; 999 is no copy
    assert fw2.expect(ClaimDisk).keep == [on_disk[0], on_disk[2]]
    wait_for(lambda: len(events_of(store, ev.WorkerJoined)) == 2, what="the loss, then the join")
    [lost] = [r.event for r in events_of(store, ev.WorkerLost)]
    assert lost.reason.startswith("worker process exited with code -9; epoch ")
    assert lost.kept_on_disk == [on_disk[0], on_disk[2]] and lost.bytes_kept == 2 * fw.block_bytes
    assert lost.blocks_lost == sorted([on_disk[1], *on_device])
    state = check_ledger(store)
    assert state.workers[0].alive and {b: st.tiers for b, st in state.blocks[0].items()} == {
        on_disk[0]: ["disk"], on_disk[2]: ["disk"]}


def test_a_worker_that_exits_holding_disk_copies_is_lost_with_them_when_no_replacement_comes(
        make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, keep_disk=True, replace_wait_s=0.3)
    on_disk = commit_blocks(proc, fw, 2, tier="disk")
    proc.worker_exited(0, fw.epoch, 1)
    wait_for(lambda: events_of(store, ev.WorkerLost), what="the loss after the wait")
    [lost] = [r.event for r in events_of(store, ev.WorkerLost)]
    assert lost.blocks_lost == on_disk and lost.kept_on_disk == []
    assert lost.reason == "worker process exited with code 1; no new incarnation within 0.3 s"
    assert not check_ledger(store).workers[0].alive


# ---------------------------------------------------------------------- recovery with a scripted worker
def _crashed_ledger(url, epoch=1):
    """A ledger as a crashed control process leaves it: three moves in flight, no ServerStopped."""
    from residency.events.envelope import Envelope
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
    # the live state keeps the copy index asks are checked against: built at recovery, kept since
    live = proc.call(lambda p: (p.state.copies, check_integrity(p.state))).result(5)[0]
    assert live is not None and live[0]["host"] >= {1, 3} and not live[0]["device"] & {1, 3}


def _crashed_ledger_with_disk(url):
    """A crashed control's ledger whose worker holds blocks 7 and 8 on disk (and 9 on device)."""
    from residency.events.envelope import Envelope
    store = LedgerStore.open(url, create=True)
    bb = 4096
    evs = [ev.ServerStarted(version="0", config_digest="x"),
           ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 64 * bb, "host": 128 * bb, "disk": 256 * bb},
                           block_bytes=bb),
           ev.BlocksCommitted(worker=0, session="s", tier="disk", blocks=[7, 8], keys=["a", "b"], bytes=2 * bb),
           ev.BlocksCommitted(worker=0, session="s", tier="device", blocks=[9], keys=[""], bytes=bb)]
    store.append([(Envelope(producer="control", epoch=7, producer_seq=i, ts_ns=time.time_ns(),
                            causation="hello:w0@1" if type(e) is ev.WorkerJoined else None), e)
                  for i, e in enumerate(evs, 1)])
    store.close()


def test_after_a_crash_disk_copies_wait_for_the_next_incarnation_which_keeps_what_it_found(
        make_control, fake_worker, sqlite_url):
    _crashed_ledger_with_disk(sqlite_url)
    proc, store = make_control(sqlite_url, adopt_grace_s=0.2, keep_disk=True, expected_workers=[0])
    wait_for(lambda: proc.call(lambda p: p.missing_workers()).result(5) == [0], what="the grace to pass")
    assert not events_of(store, ev.WorkerLost)           # not yet: the next incarnation says what it found
    fw = fake_worker(epoch=2)
    fw.hello(disk_blocks=[8, 40])                        # 7's file is gone; 40 is not the ledger's
    assert fw.expect(ClaimDisk).keep == [8]
    wait_for(lambda: events_of(store, ev.WorkerLost), what="the loss, committed")
    [lost] = [r.event for r in events_of(store, ev.WorkerLost)]
    assert (lost.blocks_lost, lost.kept_on_disk, lost.bytes_kept) == ([7, 9], [8], 4096)
    state = check_ledger(store)
    assert {b: st.tiers for b, st in state.blocks[0].items()} == {8: ["disk"]}


def test_after_a_crash_disk_copies_are_counted_lost_when_no_new_incarnation_comes(make_control, sqlite_url):
    _crashed_ledger_with_disk(sqlite_url)
    proc, store = make_control(sqlite_url, adopt_grace_s=0.2, keep_disk=True, replace_wait_s=0.3)
    wait_for(lambda: events_of(store, ev.WorkerLost), what="the loss after the wait")
    [lost] = [r.event for r in events_of(store, ev.WorkerLost)]
    assert lost.blocks_lost == [7, 8, 9] and lost.kept_on_disk == [] and "no new incarnation" in lost.reason


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
