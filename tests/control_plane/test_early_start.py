"""Early start, between real processes: a CommandAhead that carries its command lets a worker begin
a device <-> host move's copies while the MoveRequested commits. Nothing is visible before the
command itself arrives (which waits for the commit: write-ahead), a start whose command never
comes is abandoned with the pools exactly as before, and the command runs as usual after it."""
from __future__ import annotations

import json
import time

from residency.events import catalog as ev
from residency.events.commands import (
    BlocksWritten, CommandAhead, CommitBlocks, ExecuteMove, Hello, Inventory, LaneHello,
    MoveNearlyDone, MovesReport, Pong, QueryInventory, QueryMoves, Shutdown,
)
from residency.events.asks import AskCommitBlocks, AskMove

from tests.control_plane.conftest import check_ledger, gated_cluster, spawn, wait_for, worker_argv
from tests.control_plane.test_worker import Control as _Control


class Control(_Control):
    """The stand-in control; MoveNearlyDone (a move of several chunks says it) is skipped unless expected."""

    def expect(self, t, timeout: float = 10.0, skip: tuple = ()):
        while True:
            m = self.recv(timeout)
            if type(m) is t:
                return m
            assert type(m) in (Hello, Pong, LaneHello, MoveNearlyDone), m


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
    from residency.dataplane.ahead import AHEAD_HOLD_MS
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=True)
    w = spawn(worker_argv(0, endpoint, short_dir, device_blocks=256), tmp_path / "worker.log")
    try:
        ctl.expect(Hello, timeout=60)
        ctl.send(CommitBlocks(request_id="c", session="s", tier="device", blocks=list(range(200)), seed=5))
        ctl.expect(BlocksWritten)
        # 1. the hint, then (later) its command: begun on the hint, answered only after the command
        a = _evict("m-a", list(range(0, 100)))
        ctl.send(CommandAhead(move_id="m-a", within_us=1000, command=a))
        time.sleep(AHEAD_HOLD_MS / 2000)       # well inside the hold: the hint's copies start, nothing is answered
        assert ctl.sock.poll(0) == 0, "nothing is answered before the command"
        sent_ns = time.time_ns()
        ctl.send(a)
        ack = ctl.expect(ev.MoveAcked)
        assert ack.move_id == "m-a" and ack.bytes_freed_src == 100 * 16384
        # the move's clock started on the hint, before its command was sent: the copies began first (how long
        # before depends on how soon a loaded host ran the worker, so only the order is asserted)
        assert ack.started_ns < sent_ns, (sent_ns, ack.started_ns)
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


def test_through_the_control_process_the_copies_begin_before_the_commit_and_the_ack_waits_for_it(
        short_dir, tmp_path, sqlite_url):
    with gated_cluster(sqlite_url, short_dir, tmp_path / "worker.log", [],
                       command_ahead_min_bytes=64 * 16384, trace_moves=8) as (proc, store, gate, w):
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
                         and "committed" in m and m, what="the control's marks")
        # the worker's clock for the move started after the hint went and before the commit
        assert marks["ahead"] < out.events[0].started_ns < marks["committed"], (marks, out.events[0].started_ns)
        small = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[100:102])).result(30)
        assert small.error is None
        back = proc.submit(AskMove(ask_id="back", kind="restore", worker=0, blocks=blocks[:100])).result(30)
        assert back.error is None and back.events[0].checksums == out.events[0].checksums
        metrics = proc.health().metrics
        assert metrics["commands_sent_ahead"] == 2 and metrics["commands_ahead"] == 2 and metrics["lanes_woken"] == 2
        proc.stop("done")
        assert w.wait(15) == 0
        check_ledger(store)
