"""bench/placement.py: where the bench's pinned spill variants put the control's loop thread."""
from __future__ import annotations

import os
import sys
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
        assert len(pinned_zmq_threads()) == len(before) + 1
    finally:
        proc.stop("done")
        ctx.destroy(linger=0)
        store.close()
    assert len(pinned_zmq_threads()) == len(before)
