"""Early start, between real processes: a CommandAhead that carries its command lets a worker begin
a device <-> host move's copies while the MoveRequested commits. Nothing is visible before the
command itself arrives (which waits for the commit: write-ahead), a start whose command never
comes is abandoned with the pools exactly as before, and the command runs as usual after it."""
from __future__ import annotations

import json
import time

import pytest

from events import catalog as ev
from events.commands import (
    AskCommitBlocks, AskMove, BlocksWritten, CommandAhead, CommitBlocks, ExecuteMove, Hello, Inventory, LaneHello,
    MovesReport, MoveTimed, Pong, QueryInventory, QueryMoves, Shutdown,
)

from tests.control_plane.conftest import check_ledger, gated_control, joined, spawn, wait_for, worker_argv
from tests.control_plane.test_worker import Control as _Control


class Control(_Control):
    """The stand-in control; MoveTimed (--report-timings) is skipped unless expected."""

    def expect(self, t, timeout: float = 10.0):
        while True:
            m = self.recv(timeout)
            if type(m) is t:
                return m
            assert type(m) in (Hello, Pong, LaneHello, MoveTimed), m


def _evict(mid: str, blocks: list[int], **kw) -> ExecuteMove:
    return ExecuteMove(move_id=mid, kind=kw.pop("kind", "evict"), src=kw.pop("src", "device"),
                       dst=kw.pop("dst", "host"), blocks=blocks, keep_source=False, deadline_ns=0)


def _inventory(ctl: Control, nonce: int) -> dict[str, list[int]]:
    ctl.send(QueryInventory(nonce=nonce))
    inv = ctl.expect(Inventory)
    assert inv.nonce == nonce
    return inv.blocks


def test_a_worker_begins_a_move_on_its_hint_shows_nothing_before_its_command_and_drops_what_never_comes(
        short_dir, tmp_path):
    from dataplane.lane import AHEAD_HOLD_MS
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=True)
    w = spawn(worker_argv(0, endpoint, short_dir, device_blocks=256) + ["--report-timings", "--no-nearly-done"],
              tmp_path / "worker.log")
    try:
        ctl.expect(Hello, timeout=60)
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=list(range(200)), seed=5))
        ctl.expect(BlocksWritten)
        # 1. the hint, then (later) its command: begun on the hint, answered only after the command
        a = _evict("m-a", list(range(0, 100)))
        ctl.send(CommandAhead(move_id="m-a", within_us=1000, command=a))
        time.sleep(0.1)
        assert ctl.sock.poll(0) == 0, "nothing is answered before the command"
        ctl.send(a)
        ack = ctl.expect(ev.MoveAcked)
        timed = ctl.expect(MoveTimed)
        assert ack.move_id == "m-a" and ack.bytes_freed_src == 100 * 16384
        assert timed.ahead_ns and timed.engine_start_ns < timed.received_ns, timed   # the copies began first
        assert timed.received_ns - timed.ahead_ns >= 90_000_000
        # 2. a hint whose command never comes: abandoned after AHEAD_HOLD_MS, pools as before
        before = _inventory(ctl, 1)
        ctl.send(CommandAhead(move_id="m-b", within_us=1000, command=_evict("m-b", list(range(100, 150)))))
        time.sleep(2 * AHEAD_HOLD_MS / 1000)
        assert ctl.sock.poll(0) == 0
        assert _inventory(ctl, 2) == before
        # 3. another command comes first: the begun move is dropped, the other runs; then its own
        ctl.send(CommandAhead(move_id="m-c", within_us=1000, command=_evict("m-c", list(range(150, 160)))))
        ctl.send(_evict("m-d", [160, 161]))
        assert ctl.expect(ev.MoveAcked).move_id == "m-d"
        after = _inventory(ctl, 3)
        assert 150 in after["device"] and 150 not in after["host"] and 160 in after["host"]
        ctl.send(_evict("m-c", list(range(150, 160))))
        assert ctl.expect(ev.MoveAcked).move_id == "m-c"
        # 4. reported unknown while begun (the record knows no command): refused when it comes
        e = _evict("m-e", [170, 171])
        ctl.send(CommandAhead(move_id="m-e", within_us=1000, command=e))
        time.sleep(0.05)
        ctl.send(QueryMoves(move_ids=["m-e"]))
        assert ctl.expect(MovesReport).unknown == ["m-e"]
        ctl.send(e)
        refused = ctl.expect(ev.MoveRejected)
        assert refused.move_id == "m-e" and "never executed" in refused.reason
        inv = _inventory(ctl, 4)
        assert {170, 171} <= set(inv["device"]) and not {170, 171} & set(inv["host"])
        # 5. a restore begun ahead verifies what the first move wrote
        r = _evict("m-r", list(range(0, 100)), kind="restore", src="host", dst="device")
        ctl.send(CommandAhead(move_id="m-r", within_us=1000, command=r))
        ctl.send(r)
        back = ctl.expect(ev.MoveAcked)
        assert back.move_id == "m-r" and back.checksums == ack.checksums
        ctl.send(Shutdown(reason="test"))
        assert w.wait(10) == 0
    finally:
        w.kill()
        ctl.sock.close(0)
    log = [json.loads(line) for line in (tmp_path / "worker.log").read_text().splitlines() if line.startswith("{")]
    why = {e["move_id"]: e["why"] for e in log if e["event"] == "move_abandoned"}
    assert why == {"m-b": f"its command did not come within {AHEAD_HOLD_MS} ms",
                   "m-c": "ExecuteMove m-d came before its command", "m-e": "its command was tombstoned"}, log


@pytest.mark.parametrize("on_ask", [True, False], ids=["sent-on-the-ask", "sent-after-the-resolve"])
def test_through_the_control_process_the_copies_begin_before_the_commit_and_the_ack_waits_for_it(
        short_dir, tmp_path, sqlite_url, on_ask):
    proc, store, gate = gated_control(sqlite_url, short_dir, command_ahead_min_bytes=64 * 16384, trace_moves=8,
                                      start_on_ask=on_ask)
    w = spawn(worker_argv(0, proc.cfg.worker_endpoint, short_dir, device_blocks=256) + ["--report-timings"],
              tmp_path / "worker.log")
    try:
        wait_for(lambda: joined(proc), timeout=60, what="worker joined")
        ans = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=120)).result(30)
        blocks = ans.events[0].blocks
        gate.clear()                                   # the MoveRequested cannot commit yet
        fut = proc.submit(AskMove(ask_id="big", kind="evict", worker=0, blocks=blocks[:100]))
        time.sleep(0.2)
        assert not fut.done(), "no outcome before the commit"
        gate.set()
        out = fut.result(30)
        assert out.error is None and type(out.events[0]) is ev.MoveAcked, out
        mid = out.move_ids[0]
        marks = wait_for(lambda: (m := proc.call(lambda p: dict(p.traces.by_move.get(mid, {}))).result(5))
                         and "w_sent" in m and m, what="the worker's timings")
        assert marks["ahead"] < marks["w_engine_start"] < marks["committed"] < marks["w_received"], marks
        small = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[100:102])).result(30)
        assert small.error is None
        back = proc.submit(AskMove(ask_id="back", kind="restore", worker=0, blocks=blocks[:100])).result(30)
        assert back.error is None and back.events[0].checksums == out.events[0].checksums
        metrics = proc.health().metrics
        if on_ask:      # the asks' own commands went before their resolve; nothing else was sent ahead
            assert metrics["commands_sent_on_ask"] == 2 and "commands_withdrawn" not in metrics, metrics
            assert "commands_ahead" not in metrics and "lanes_woken" not in metrics, metrics
        else:
            assert metrics["commands_sent_ahead"] == 2 and metrics["commands_ahead"] == 2 and metrics["lanes_woken"] == 2
            assert "commands_sent_on_ask" not in metrics
        proc.stop("done")
        assert w.wait(15) == 0
        check_ledger(store)
    finally:
        gate.set()
        proc.stop()
        w.kill()
        store.close()


def test_a_command_sent_on_an_ask_that_is_refused_or_resolved_otherwise_is_withdrawn_and_undone(
        short_dir, tmp_path, sqlite_url):
    """The control sends a big ask's command before resolving it (``start_on_ask``): when the
    ask is refused (over budget), invalid, or means other moves than the guessed one, the command
    is withdrawn, the worker undoes what it began (nothing was visible) and the moves that follow
    run as usual; the ledger holds no trace of the guess."""
    from events.commands import AskSetBudget
    proc, store, _gate = gated_control(sqlite_url, short_dir, command_ahead_min_bytes=64 * 16384, trace_moves=8)
    w = spawn(worker_argv(0, proc.cfg.worker_endpoint, short_dir, device_blocks=256), tmp_path / "worker.log")
    try:
        wait_for(lambda: joined(proc), timeout=60, what="worker joined")
        ans = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=120)).result(30)
        blocks = ans.events[0].blocks
        # 1. refused: the host's ceiling leaves room for 50 blocks, the ask names 100
        assert proc.submit(AskSetBudget(ask_id="b", worker=0, tier="host", floor_bytes=0,
                                        ceiling_bytes=50 * 16384)).result(30).error is None
        out = proc.submit(AskMove(ask_id="over", kind="evict", worker=0, blocks=blocks[:100])).result(30)
        assert out.error is None and type(out.events[0]) is ev.MoveRefused, out
        assert proc.submit(AskSetBudget(ask_id="b2", worker=0, tier="host", floor_bytes=0,
                                        ceiling_bytes=8 << 20)).result(30).error is None
        # 2. resolved otherwise: 10 of the blocks already have a copy on the host (a spill kept the
        # source), so the evict means a copy of 90 and a release of 10, not the one guessed move
        spill = proc.submit(AskMove(ask_id="s", kind="spill", worker=0, blocks=blocks[:10])).result(30)
        assert spill.error is None and type(spill.events[0]) is ev.MoveAcked
        out = proc.submit(AskMove(ask_id="split", kind="evict", worker=0, blocks=blocks[:100])).result(30)
        assert out.error is None and len(out.move_ids) == 2, out
        assert [type(e) for e in out.events if type(e).__name__.startswith("Move")] == [ev.MoveAcked] * 2, out
        # 3. invalid (now on the host only): the worker refused to begin it, the control answers why
        out = proc.submit(AskMove(ask_id="bad", kind="evict", worker=0, blocks=blocks[:100])).result(30)
        assert out.error == "invalid_ask" and "no copy on device" in out.detail, out
        # 4. the guess right: the blocks come back in one move, each checksum as it went
        back = proc.submit(AskMove(ask_id="back", kind="restore", worker=0, blocks=blocks[10:100])).result(30)
        assert back.error is None and len(back.move_ids) == 1 and type(back.events[0]) is ev.MoveAcked, back
        metrics = proc.health().metrics
        assert metrics["commands_sent_on_ask"] == 4 and metrics["commands_withdrawn"] == 3, metrics
        proc.stop("done")
        assert w.wait(15) == 0
        state = check_ledger(store)
        wb = state.blocks[0]
        assert {b: wb[b].tiers for b in blocks} == {b: ["host"] if b in blocks[:10] else ["device"] for b in blocks}
        types = [type(r.event).__name__ for r in store.read()]
        assert types.count("MoveRequested") == types.count("MoveAcked") == 4, types   # spill, 2 of the split, restore
    finally:
        proc.stop()
        w.kill()
        store.close()
    log = [json.loads(line) for line in (tmp_path / "worker.log").read_text().splitlines() if line.startswith("{")]
    withdrawn = [e for e in log if e["event"] == "move_abandoned"]
    # the refused one was begun and undone; the worker never began the split one (10 of its
    # blocks are on the host already) nor the invalid one: its own checks refused them
    assert [(e["move_id"], e["why"]) for e in withdrawn] == [(back.move_ids[0].rsplit("-", 1)[0] + "-1",
                                                             "the control withdrew it")], withdrawn
