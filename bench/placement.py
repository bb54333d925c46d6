"""CPU placement of the control's loop thread and its ZMQ I/O thread, for the bench's ``pinned``
and ``pin-control`` spill variants (bench/control_spill.py).

A ZMQ hop wakes the sender's I/O thread, the receiver's I/O thread and the receiving thread. With
an app thread and its context's I/O thread on one CPU, the I/O thread is woken where the app
thread has just run (a send) or is about to run (a receive). Between busy threads that halves a
hop; after a long idle it helps less, and it hurts an awake poll for an ack (the poll and the I/O
thread it waits for then share one CPU): the 2 GiB spill through the control process was slower
with it (bench/RESULTS.md, control), so ``residency serve`` places nothing.

Only the loop thread is placed, after the control started the ledger writer's thread (threads
inherit their creator's placement).
"""
from __future__ import annotations

import os
from pathlib import Path

import zmq

MIN_CPUS_TO_PIN = 8     # below this, every CPU is needed for everything: nothing is placed


def check_cpu(cpu: int) -> None:
    allowed = os.sched_getaffinity(os.getpid())
    if cpu not in allowed:
        raise ValueError(f"cpu {cpu} is not one this process may run on (allowed: {sorted(allowed)})")


def context_on(cpu: int) -> zmq.Context:
    """A new context whose I/O thread (started with its first socket) runs on ``cpu``: hand it to
    ``ControlProc(ctx=...)`` and destroy it after the control stopped."""
    check_cpu(cpu)
    ctx = zmq.Context()
    ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    return ctx


def pin_loop(proc, cpu: int) -> None:
    """Run a started control's loop thread on ``cpu`` only (Linux: pid 0 is the calling thread)."""
    check_cpu(cpu)
    proc.call(lambda _p: os.sched_setaffinity(0, {cpu})).result(10)


def plan(num_workers: int, allowed: set[int] | None = None) -> tuple[int | None, list[int | None]]:
    """CPUs for the control loop and each worker's engine thread: the highest-numbered allowed
    CPUs, one each, when the host has at least ``MIN_CPUS_TO_PIN`` and at least four are left for
    everything else; otherwise nothing is placed (None)."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(os.getpid()))
    if len(cpus) < MIN_CPUS_TO_PIN or len(cpus) - (1 + num_workers) < 4:
        return None, [None] * num_workers
    return cpus[-1], [cpus[-2 - i] for i in range(num_workers)]


def thread_cpus(name_prefix: str) -> dict[str, set[int]]:
    """This process's threads whose name starts with ``name_prefix`` -> the CPUs each may run on
    (read from /proc)."""
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(name_prefix):
            out[f"{name}/{task.name}"] = os.sched_getaffinity(int(task.name))
    return out
