"""CPU placement of a worker's device thread and of its ZMQ I/O thread, and the awake poll.

A ZMQ hop wakes the sender's I/O thread, the receiver's I/O thread and the receiving thread. With
the device thread and its context's I/O thread on one CPU, the I/O thread is woken where the
device thread has just run (a send) or is about to run (a receive), so a hop between busy threads
costs less; after a long idle it helps less, and it can hurt a poll that spins for a message
(the poll and the I/O thread it waits for then share one CPU). So it is off unless asked for:
the worker's ``--cpu`` (bench/RESULTS.md has the measurements).

Threads started later inherit the placement, so only the device thread is placed, never a thread
that starts CPU-parallel work (torch's OpenMP pool: a CPU worker's model runs on its device
thread, so only GPU workers place theirs).
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
    (then []): for a message known to be on its way (a CommandAhead's command), read the moment it
    lands instead of after a long-idle thread wakes (bench/zmq_wake.py).

    ``give_way``: yield the CPU between polls, for a thread pinned beside its ZMQ I/O thread (which
    must run on that CPU for the message to land). Unpinned, a yield only hands the CPU to whatever
    else may run there, for a whole slice."""
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
