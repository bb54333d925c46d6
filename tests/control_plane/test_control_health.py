"""The control loop's health against a scripted worker: a stalled or failing ledger, back-pressure,
live == replay, stranded room, snapshots, a broken handler, pressure spills."""
from __future__ import annotations

import random
import threading
import time

import pytest

from residency.events import catalog as ev
from residency.events.commands import ExecuteMove
from residency.events.asks import AskMove, AskSetBudget, AskStatus
from residency.ledger import LedgerStore

from tests.control_plane.conftest import (  # noqa: E402
    FailingDisk as _FailingDisk, SlowDisk as _SlowDisk, check_ledger, commit_blocks, event_types as _types,
    events_of, joined, setup_control as _setup, wait_for,
)


# ---------------------------------------------------------------------- health and back-pressure


@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_a_stalled_ledger_is_never_behind_a_green_health_check(fake_worker, sqlite_url, short_dir, inline):
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
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
        # asked from another thread while the loop is stuck: both problems show once they pass
        # stall_after_s (waited for, not slept for: a loaded runner may be slow to get stuck)
        h = wait_for(lambda: (h := proc.health()) and not h.healthy and any("stalled" in p for p in h.problems)
                     and any("lagging" in p for p in h.problems) and h, timeout=10, what="the stall reported")
        assert not gate.is_set() and not h.healthy, h
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
    from residency.control.fold import fold_all
    from residency.control.state import State
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
    # an ask for its blocks is told which move holds them and why, not only that they are busy
    busy = proc.submit(AskMove(ask_id="r1b", kind="restore", worker=0, blocks=blocks[:2])).result(5)
    assert busy.error == "invalid_ask" and not busy.events
    assert f"move {cmd.move_id} (restore host -> device" in busy.detail and "is stranded" in busy.detail
    # the worker answers: it refused to start it (its deadline had passed): the room is free again
    fw.send(ev.MoveRejected(move_id=cmd.move_id, worker=0, reason="deadline: passed before the move could start",
                            asked_bytes=50 * bb))
    wait_for(lambda: proc.call(lambda p: cmd.move_id not in p.state.stranded).result(5), what="answered")
    fut = proc.submit(AskMove(ask_id="r3", kind="restore", worker=0, blocks=blocks[50:80]))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert type(fut.result(5).events[0]) is ev.MoveAcked
    state = check_ledger(store)
    # the rejection closed the stranding in the ledger: nothing is at risk any more, no copy moved
    (closed,) = [r.event for r in store.read() if type(r.event) is ev.MoveLateFailed]
    assert (closed.move_id, closed.answer) == (cmd.move_id, "MoveRejected")
    assert "deadline" in closed.reason
    assert cmd.move_id not in state.stranded and state.stranded_bytes_total() == 0
    assert state.outcomes[cmd.move_id] == "MoveLateFailed"
    assert all("device" not in state.blocks[0][b].tiers for b in blocks[:50])


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
    from residency.control.proc import LedgerDiverged
    from residency.events.envelope import Envelope
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
    from residency.control.fold import fold_all
    from residency.control.recovery import replay
    from residency.control.state import State
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


def test_the_server_anchors_its_head_every_n_events_and_at_stop(make_control, fake_worker, sqlite_url, tmp_path):
    from residency.ledger import anchor
    key_file = tmp_path / "anchor.key"
    key_file.write_bytes(random.randbytes(32))
    path = tmp_path / "heads.anchor"
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, anchor_file=str(path),
                             anchor_key_file=str(key_file), anchor_every_events=5)
    blocks = commit_blocks(proc, fw, 6)
    for i, b in enumerate(blocks):
        fut = proc.submit(AskMove(ask_id=f"a{i}", kind="evict", worker=0, blocks=[b]))
        fw.send(fw.ack(fw.expect(ExecuteMove)))
        fut.result(5)
    proc.stop("anchor test")
    heads = anchor.read(path, anchor.load_key(key_file))
    assert len(heads) >= 2 and [h.seq for h in heads] == sorted({h.seq for h in heads})
    last = store.last_seq()
    assert heads[-1].seq == last and heads[-1].row_hash == bytes(store.peek_raw(last)[10])
    assert store.verify(anchors=heads).ok


def test_a_plugged_in_handler_that_raises_is_logged_and_the_loop_goes_on(make_control, fake_worker, sqlite_url):
    from residency.events.commands import Pong
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
    from residency.control.policy import PolicyConfig
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


def _on_a_disk_that_can_fail(fake_worker, url, short_dir, inline: bool = True):
    """A control process whose ledger fails once ``disk.broken`` is set, a worker joined and two
    blocks committed: (proc, store, disk, worker, blocks)."""
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
    store = LedgerStore.open(url, create=True)
    disk = _FailingDisk(store)
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", commit_inline=inline, release_on_stop=False,
                        policy=PolicyConfig(pressure=False, park=False))
    proc = ControlProc(disk, cfg).start()
    fw = fake_worker()
    fw.hello()
    wait_for(lambda: joined(proc), what="worker joined")
    return proc, store, disk, fw, commit_blocks(proc, fw, 2)


@pytest.mark.parametrize("inline", [True, False], ids=["inline-commit", "group-commit-writer"])
def test_a_move_whose_request_cannot_be_committed_is_never_sent(fake_worker, sqlite_url, short_dir, inline):
    from residency.ledger.errors import LedgerUnavailable
    proc, store, disk, fw, blocks = _on_a_disk_that_can_fail(fake_worker, sqlite_url, short_dir, inline)
    try:
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


def test_a_ledger_that_fails_committing_an_ack_stops_the_control_and_nothing_is_answered(fake_worker, sqlite_url,
                                                                                        short_dir):
    """The ack's commit runs inside its message handler (the short way): a ledger error there must
    end the loop like any failed commit, never be logged as one handler's bug while the loop goes on
    with events folded that were never committed."""
    from residency.ledger.errors import LedgerUnavailable
    proc, store, disk, fw, blocks = _on_a_disk_that_can_fail(fake_worker, sqlite_url, short_dir)
    try:
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
