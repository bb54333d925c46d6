"""The control loop kept awake for an outcome on its way: a worker's MoveNearlyDone (polled for
until that move's outcome, the ledger writer warmed before its estimate)."""
from __future__ import annotations

import time

from residency.events.commands import ExecuteMove, MoveNearlyDone
from residency.events.asks import AskMove

from tests.control_plane.conftest import check_ledger, commit_blocks, setup_control as _setup, wait_for  # noqa: E402


def test_a_nearly_done_hint_keeps_the_loop_awake_until_that_moves_outcome_and_nothing_else_changes(
        make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ack_spin_max_us=2_000_000)
    blocks = commit_blocks(proc, fw, 4)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks[:2]))
    cmd = fw.expect(ExecuteMove)
    fw.send(MoveNearlyDone(move_id="m-nobody", worker=0, bytes_left=1 << 30))     # no such move: ignored
    fw.send(MoveNearlyDone(move_id=cmd.move_id, worker=0, bytes_left=1 << 30))
    wait_for(lambda: proc.health().metrics.get("awake_polls", 0) > 0, what="the loop polls awake")
    assert proc.call(lambda p: sorted(p.awake.until_by_move)).result(5) == [cmd.move_id]
    fw.send(fw.ack(cmd))
    assert fut.result(5).error is None
    assert proc.call(lambda p: dict(p.awake.until_by_move)).result(5) == {}, "the outcome ends the wait at once"
    m = proc.health().metrics
    assert m["nearly_done_hints"] == 2 and m["outcome_terminal"] == 1
    assert m["writer_warm_ups"] == 1                  # the known move's hint warmed the ledger's writer
    proc.stop("done")
    check_ledger(store)


def test_a_hint_with_an_estimate_warms_the_ledger_writer_shortly_before_that_time_not_at_once(
        make_control, fake_worker, sqlite_url):
    proc, store, fw = _setup(make_control, fake_worker, sqlite_url, ack_spin_max_us=2_000_000, warm_lead_us=100_000)
    blocks = commit_blocks(proc, fw, 2)
    fut = proc.submit(AskMove(ask_id="a", kind="evict", worker=0, blocks=blocks))
    cmd = fw.expect(ExecuteMove)
    t0 = time.monotonic()
    fw.send(MoveNearlyDone(move_id=cmd.move_id, worker=0, bytes_left=1 << 34, eta_us=600_000))
    wait_for(lambda: proc.health().metrics.get("writer_warm_ups", 0) == 1, what="the writer warmed")
    assert time.monotonic() - t0 >= 0.45, "warmed at eta - lead (0.5 s), not at once"
    fw.send(fw.ack(cmd))
    assert fut.result(5).error is None
    assert proc.health().metrics["writer_warm_ups"] == 1
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
    assert proc.call(lambda p: dict(p.awake.until_by_move)).result(5) == {}
    fw.send(fw.ack(cmd))
    assert fut.result(5).error is None
    assert proc.health().metrics.get("awake_polls", 0) == 0
    assert proc.health().metrics.get("writer_warm_ups", 0) == 0
    proc.stop("done")
    check_ledger(store)
