"""Keeping the host awake through big moves (control/keep_awake.py): SCHED_IDLE spinners, one per
CPU, that spin only inside the windows the control opens, and a control process that opens one
when a big move is requested and lets it end (after a linger) once no big move is in flight."""
from __future__ import annotations

import os
import time

from residency.events import catalog as ev
from residency.events.asks import AskCommitBlocks, AskMove

from residency.control.keep_awake import KeepAwake
from tests.control_plane.conftest import check_ledger, gated_cluster, spawn, wait_for

S = 10**9


def _state(pid: int) -> str:
    """The process's scheduler state (/proc/PID/stat): R running or runnable, S asleep."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _spinning(p, samples: int = 8) -> bool:
    """Runnable at every sample (a spinner preempted by busier work is still R, never S)."""
    return all(_state(p.pid) == "R" and not time.sleep(0.02) for _ in range(samples))


def _asleep(p, samples: int = 8) -> bool:
    wait_for(lambda: _state(p.pid) == "S", timeout=5, interval=0.01, what="the spinner asleep")
    return all(_state(p.pid) == "S" and not time.sleep(0.02) for _ in range(samples))


def test_spinners_sleep_until_a_window_spin_through_it_and_go_back_to_sleep():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    ka = KeepAwake([cpu])
    try:
        (p,) = ka._procs
        wait_for(lambda: os.sched_getscheduler(p.pid) == os.SCHED_IDLE, timeout=10, what="the spinner set up")
        assert os.sched_getaffinity(p.pid) == {cpu}
        assert _asleep(p), "asleep before any window"
        ka.until(time.monotonic_ns() + 10 * S)
        assert ka.windows == 1 and _spinning(p), "spinning inside the window"
        ka.until(time.monotonic_ns() + 5 * S)              # until() never shortens ...
        assert ka.awake_until > time.monotonic_ns() + 9 * S
        ka.until(time.monotonic_ns() + 20 * S)             # ... it lengthens, without a new window
        assert ka.windows == 1
        others = os.sched_getaffinity(0) - {cpu}
        mine = os.sched_getaffinity(0)
        if others:          # stores from another CPU than the spinner's, while it reads
            os.sched_setaffinity(0, others)
        try:
            for i in range(20000):                         # moving the end while it spins never stops it
                ka.end_at(time.monotonic_ns() + 20 * S + (i % 7) * 1_000_003)
        finally:
            os.sched_setaffinity(0, mine)
        assert _spinning(p)
        ka.end_at(0)                                       # end_at() shortens: asleep again
        assert ka.awake_until == 0 and _asleep(p), "asleep again once the window ended"
        ka.until(time.monotonic_ns() + 10 * S)
        ka.end_at(time.monotonic_ns() + S // 2)            # a window that ends by itself
        assert ka.windows == 2 and _spinning(p, 3)
        time.sleep(0.2)
        assert _asleep(p), "asleep once its window passed"
        ka.end_at(time.monotonic_ns() + 10 * S)            # end_at() lengthens too, waking them
        assert ka.windows == 3 and _spinning(p)
    finally:
        ka.stop()
    assert p.returncode is not None and ka._procs == []      # exited, or killed when starved (SCHED_IDLE)


def test_a_spinner_whose_control_is_gone_exits_once_its_window_is_over():
    ka = KeepAwake([sorted(os.sched_getaffinity(0))[0]])
    (p,) = ka._procs
    ka.until(time.monotonic_ns() + 2 * S)
    p.stdin.close()                      # what the control's death does to the pipe
    time.sleep(0.2)
    assert p.poll() is None, "still inside its window"   # (1.8 s of margin for a loaded runner)
    assert p.wait(30) == 0                # (a starved SCHED_IDLE spinner can take a while)
    ka._procs = []


def test_the_control_keeps_the_host_awake_while_a_big_move_is_in_flight(short_dir, tmp_path, sqlite_url):
    with gated_cluster(sqlite_url, short_dir, tmp_path / "worker.log", keep_awake=True,
                       keep_awake_min_bytes=64 * 16384, keep_awake_linger_s=0.0) as (proc, store, gate, w):

        def window():       # read from this thread: the loop may be held in the gated commit
            ka = proc.keep_awake
            return ka.spinners.windows, ka.awake, set(ka.moving)
        assert len(proc.call(lambda p: p.keep_awake.spinners._procs).result(5)) == len(os.sched_getaffinity(0))
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
        assert out.error is None and type(out.events[0]) is ev.MoveAcked and moving == set(out.move_ids)
        # (the asker hears before the loop is done with the move: wait for it)
        wait_for(lambda: window() == (1, False, set()), what="the window over once the move is settled (no linger)")
        proc.call(lambda p: setattr(p.keep_awake, "linger_s", 30.0)).result(5)
        back = proc.submit(AskMove(ask_id="back", kind="restore", worker=0, blocks=blocks[:100])).result(30)
        assert type(back.events[0]) is ev.MoveAcked
        # (a window may have ended before the restore was settled: the linger then opens a third)
        wait_for(lambda: window()[0] >= 2 and window()[1:] == (True, set())
                 and proc.keep_awake.spinners.awake_until > time.monotonic_ns() + 20 * S,
                 what="the window lingering (30 s) after the last big move")
        spinners = proc.call(lambda p: list(p.keep_awake.spinners._procs)).result(5)
        proc.stop("done")
        assert all(sp.returncode is not None for sp in spinners), "the spinners stop with the control"
        assert w.wait(15) == 0
        check_ledger(store)


def test_serve_keeps_the_host_awake_with_gpu_workers_or_when_asked(tmp_path):
    from residency.control.cli.main import build_parser
    from residency.control.cli.serve_cmd import build_config
    for flag, devices, want in (("auto", ["cuda:0"], True), ("auto", ["cpu"], False), ("on", ["cpu"], True),
                                ("off", ["cuda:0", "cuda:1"], False)):
        args = build_parser().parse_args(["serve", "--keep-awake", flag])
        assert build_config(args, tmp_path, devices).keep_awake is want, (flag, devices)


def _spinners_of(pid: int) -> list[int]:
    """Spinner processes (control/keep_awake.py) among the children of ``pid``."""
    out = []
    kids = [c for t in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    for child in kids:            # (each thread's: the control's loop thread starts them)
        try:
            if "SCHED_IDLE" in open(f"/proc/{child}/cmdline").read():
                out.append(int(child))
        except OSError:
            pass
    return out


def test_residency_serve_keep_awake_on_starts_a_spinner_per_cpu_and_stops_them_with_it(tmp_path, short_dir):
    import signal

    from tests.control_plane.test_worker_kill import serve_argv
    serve = spawn(serve_argv(f"sqlite:///{tmp_path / 'l.db'}", short_dir, keep_awake="on"),
                  tmp_path / "serve.log")
    try:
        spinners = wait_for(lambda: len(s := _spinners_of(serve.pid)) == len(os.sched_getaffinity(0)) and s,
                            timeout=60, what="a spinner per CPU")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        assert not [p for p in spinners if os.path.exists(f"/proc/{p}") and
                    open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"], "spinners left behind"
    finally:
        serve.kill()
