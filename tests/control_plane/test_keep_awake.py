"""Keeping the host awake through a big move (control/keep_awake.py): SCHED_IDLE spinners, one per
CPU, that spin only inside the windows the control opens, and a control process that opens one for
a big ask and closes it when the move is settled (or the ask refused)."""
from __future__ import annotations

import os
import time

from events import catalog as ev
from events.commands import AskCommitBlocks, AskMove, AskSetBudget

from control.keep_awake import KeepAwake
from tests.control_plane.conftest import check_ledger, gated_control, joined, spawn, wait_for, worker_argv

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/PID/stat fields 14 and 15)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _used(ka: KeepAwake, seconds: float) -> float:
    before = [_cpu_s(p.pid) for p in ka._procs]
    time.sleep(seconds)
    return max(_cpu_s(p.pid) - b for p, b in zip(ka._procs, before))


def test_spinners_sleep_until_a_window_spin_through_it_and_go_back_to_sleep():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    ka = KeepAwake([cpu])
    try:
        (p,) = ka._procs
        wait_for(lambda: os.sched_getscheduler(p.pid) == os.SCHED_IDLE, timeout=10, what="the spinner set up")
        assert os.sched_getaffinity(p.pid) == {cpu}
        assert _used(ka, 0.3) < 0.05, "asleep before any window"
        ka.until(time.monotonic_ns() + 10 * 10**9)
        assert ka.windows == 1 and _used(ka, 0.4) > 0.2, "spinning inside the window"
        ka.until(time.monotonic_ns() + 5 * 10**9)          # never shortened
        assert ka.awake_until > time.monotonic_ns() + 9 * 10**9
        ka.release()
        time.sleep(0.05)
        assert ka.awake_until == 0 and _used(ka, 0.3) < 0.05, "asleep again once released"
        ka.until(time.monotonic_ns() + 200 * 10**6)          # a window that ends by itself
        assert ka.windows == 2
        time.sleep(0.3)
        assert _used(ka, 0.3) < 0.05, "asleep once its window passed"
    finally:
        ka.stop()
    assert p.returncode == 0 and ka._procs == []


def test_a_spinner_whose_control_is_gone_exits():
    ka = KeepAwake([sorted(os.sched_getaffinity(0))[0]])
    (p,) = ka._procs
    ka.until(time.monotonic_ns() + 300 * 10**6)
    p.stdin.close()                      # what the control's death does to the pipe
    assert p.wait(5) == 0                # after its window at most
    ka._procs = []


def test_the_control_keeps_the_host_awake_from_a_big_ask_until_its_move_is_settled(short_dir, tmp_path, sqlite_url):
    proc, store, gate = gated_control(sqlite_url, short_dir, keep_awake=True, keep_awake_min_bytes=64 * 16384)
    w = spawn(worker_argv(0, proc.cfg.worker_endpoint, short_dir, device_blocks=256), tmp_path / "worker.log")

    def window():
        return proc.call(lambda p: (p._keep_awake.windows, p._keep_awake.awake_until > time.monotonic_ns(),
                                    set(p._awake_moves))).result(5)
    try:
        wait_for(lambda: joined(proc), timeout=60, what="worker joined")
        assert len(proc.call(lambda p: p._keep_awake._procs).result(5)) == len(os.sched_getaffinity(0))
        blocks = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device",
                                             num_blocks=120)).result(30).events[0].blocks
        small = proc.submit(AskMove(ask_id="small", kind="evict", worker=0, blocks=blocks[100:102])).result(30)
        assert small.error is None and window() == (0, False, set()), "a small move wakes nothing"
        gate.clear()                                   # the big move's MoveRequested cannot commit yet
        fut = proc.submit(AskMove(ask_id="big", kind="evict", worker=0, blocks=blocks[:100]))
        n, open_, moving = wait_for(lambda: (w_ := window())[2] and w_, what="the big move requested")
        assert n == 1 and open_ and len(moving) == 1
        gate.set()
        out = fut.result(30)
        assert out.error is None and type(out.events[0]) is ev.MoveAcked
        assert window() == (1, False, set()), "released once the move is settled"
        # refused: the window the ask opened is closed with the refusal
        assert proc.submit(AskSetBudget(ask_id="b", worker=0, tier="device", floor_bytes=0,
                                        ceiling_bytes=110 * 16384)).result(30).error is None
        out = proc.submit(AskMove(ask_id="back", kind="restore", worker=0, blocks=blocks[:100])).result(30)
        assert type(out.events[0]) is ev.MoveRefused, out
        assert window() == (2, False, set())
        spinners = proc.call(lambda p: list(p._keep_awake._procs)).result(5)
        proc.stop("done")
        assert all(sp.returncode is not None for sp in spinners), "the spinners stop with the control"
        assert w.wait(15) == 0
        check_ledger(store)
    finally:
        gate.set()
        proc.stop()
        w.kill()
        store.close()
    assert not proc.running
