"""CPU placement of the threads that carry a move's messages (the control's loop thread, a worker's
engine thread) and of the ZMQ I/O thread beside each.

A ZMQ hop wakes the sender's I/O thread, the receiver's I/O thread and the receiving thread. With
an app thread and its context's I/O thread on one CPU, the I/O thread is woken where the app
thread has just run (a send) or is about to run (a receive). Measured on the H200 host
(bench/zmq_wake.py, 2026-12-04): between busy threads a hop costs about half (command 0.045 vs
0.087 ms, ack 0.069 vs 0.127); after a 40 ms idle it helps less (ack 0.28 vs 0.36 ms) and it
hurts the control's awake poll for an ack (MoveNearlyDone: the poll and the I/O thread it waits
for then share one CPU; ack 0.30 vs 0.14 ms), and the 2 GiB spill through the control process was
slower with it (bench/control.py variants). So it is off unless asked for: ``ControlConfig.cpu``,
the worker's ``--cpu``.

Only those two threads are placed. Threads they start later inherit the placement, so the
caller places its thread after starting its helpers (the ledger writer) and never on a thread
that starts CPU-parallel work (torch's OpenMP pool: a CPU worker's model runs on its engine thread,
so only GPU workers place theirs).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

MIN_CPUS_TO_PIN = 8     # below this, every CPU is needed for everything: nothing is placed


def context_on(cpu: int | None) -> zmq.Context:
    """A new context whose I/O thread (started with its first socket) runs on ``cpu``; the
    process's shared instance when ``cpu`` is None."""
    if cpu is None:
        return zmq.Context.instance()
    check_cpu(cpu)
    ctx = zmq.Context()
    ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    return ctx


def pin_this_thread(cpu: int | None) -> None:
    """Run the calling thread on ``cpu`` only (Linux: pid 0 is the calling thread). None: no-op."""
    if cpu is not None:
        check_cpu(cpu)
        os.sched_setaffinity(0, {cpu})


def poll_until(poller: zmq.Poller, until_ns: int, give_way: bool = False) -> list:
    """Poll without sleeping until something is ready or the monotonic clock reaches ``until_ns``
    (then []): for a message known to be on its way (MoveNearlyDone, CommandAhead), read the moment
    it lands instead of after a long-idle thread wakes (bench/zmq_wake.py).

    ``give_way``: yield the CPU between polls, for a thread pinned beside its ZMQ I/O thread (which
    must run on that CPU for the message to land). Unpinned, a yield only hands the CPU to whatever
    else may run there: with control/keep_awake.py's SCHED_IDLE spinners, to a spinner for a whole
    slice (H200, 2 GiB spill: control overhead p50 3.5 ms with yields and spinners, 0.69 without
    yields; without spinners the yield changed nothing, 0.89/0.92 vs 0.93/1.49 ms)."""
    while True:
        ready = poller.poll(0)
        if ready or time.monotonic_ns() >= until_ns:
            return ready
        if give_way:
            os.sched_yield()


def check_cpu(cpu: int) -> None:
    allowed = os.sched_getaffinity(os.getpid())
    if cpu not in allowed:
        raise ValueError(f"cpu {cpu} is not one this process may run on (allowed: {sorted(allowed)})")


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
    (read from /proc; for tests and ``residency status``-like checks)."""
    out: dict[str, set[int]] = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(name_prefix):
            out[f"{name}/{task.name}"] = os.sched_getaffinity(int(task.name))
    return out
