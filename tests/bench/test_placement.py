"""bench/placement.py and bench/worker.py --cpu: where the bench's pinned spill variants put the
control's loop thread and the worker's threads."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import placement  # noqa: E402


def test_the_placement_plan_leaves_small_hosts_alone():
    assert placement.plan(1, set(range(4))) == (None, [None])
    assert placement.plan(2, set(range(16))) == (15, [14, 13])
    assert placement.plan(5, set(range(8))) == (None, [None] * 5)       # four CPUs must stay free


def test_a_control_placed_on_a_cpu_runs_its_loop_and_its_zmq_thread_there(tmp_path):
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
    from residency.ledger import LedgerStore

    cpu = max(os.sched_getaffinity(0))

    def pinned_zmq_threads() -> list[str]:
        return [name for name, cpus in placement.thread_cpus("ZMQbg/IO").items() if cpus == {cpu}]

    before = pinned_zmq_threads()
    store = LedgerStore.open(f"sqlite:///{tmp_path}/l.db", create=True)
    ctx = placement.context_on(cpu)
    proc = ControlProc(store, ControlConfig(worker_endpoint=f"ipc://{tmp_path}/w.sock", release_on_stop=False,
                                            policy=PolicyConfig(pressure=False, park=False)), ctx=ctx).start()
    try:
        placement.pin_loop(proc, cpu)
        assert proc.call(lambda p: os.sched_getaffinity(0)).result(5) == {cpu}
        # libzmq's I/O thread names itself and sets its own affinity once it first runs: on a loaded
        # host that can come after the control's loop already answers, so wait for it (not a timing
        # threshold: the assertion is about where the thread runs, the wait only lets it start)
        deadline = time.monotonic() + 10
        while len(pinned_zmq_threads()) != len(before) + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pinned_zmq_threads()) == len(before) + 1
    finally:
        proc.stop("done")
        ctx.destroy(linger=0)
        store.close()
    assert len(pinned_zmq_threads()) == len(before)


def test_the_benches_worker_on_a_cpu_runs_every_thread_there(tmp_path):
    import subprocess
    import time

    cpu = max(os.sched_getaffinity(0))
    w = subprocess.Popen([sys.executable, str(REPO / "bench" / "worker.py"), "--nocopy", "--cpu", str(cpu),
                          "--worker", "0", "--control", f"ipc://{tmp_path}/w.sock", "--run-dir", str(tmp_path),
                          "--device", "cpu", "--model", "none"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        threads: dict[int, set[int]] = {}
        while time.monotonic() < deadline:
            threads = {}
            for task in Path(f"/proc/{w.pid}/task").iterdir():
                try:
                    threads[(task / "comm").read_text().strip()] = os.sched_getaffinity(int(task.name))
                except OSError:
                    pass
            if any(name.startswith("ZMQbg/IO") for name in threads):
                break
            time.sleep(0.1)
        assert any(name.startswith("ZMQbg/IO") for name in threads), threads
        assert all(cpus == {cpu} for cpus in threads.values()), threads
    finally:
        w.kill()
        w.wait(10)
