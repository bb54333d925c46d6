"""CPU placement of a worker's engine thread and of the ZMQ I/O thread beside it, and the awake
poll of its engine lane (what dataplane/ uses; the control process places nothing, and polls
awake with control/awake_poll.py).

A ZMQ hop wakes the sender's I/O thread, the receiver's I/O thread and the receiving thread. With
an app thread and its context's I/O thread on one CPU, the I/O thread is woken where the app
thread has just run (a send) or is about to run (a receive): between busy threads a hop costs
about half; after a long idle it helps less (bench/zmq_wake.py, bench/RESULTS.md). So it is off
unless asked for: the worker's ``--cpu``.

Threads started later inherit the placement, so the caller places its thread after starting its
helpers and never on a thread that starts CPU-parallel work (torch's OpenMP pool: a CPU worker's
model runs on its engine thread, so only GPU workers place theirs).
"""
from __future__ import annotations

import os
import time

import zmq


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
    slice (bench/RESULTS.md, control: keep-awake)."""
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
