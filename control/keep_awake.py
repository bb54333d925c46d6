"""Keep the host's CPUs from halting while a big move is in flight.

On the H200 guests a thread woken on a halted vCPU takes 0.05-0.15 ms to run, and a move through
the control process wakes one at every hop (the ask, the command, the ack, the answer: each a ZMQ
I/O thread and the thread that reads it). Kept from halting, the same hops cost a third to a half
(bench/zmq_wake.py; bench/control.py spill, part ``awake``: the 2 GiB spill's control overhead
p50 0.69 ms vs 0.93-1.49 in the same runs). The guest has no cpuidle driver to tune, so this does
what a guest's ``idle=poll`` would, but only while it pays:

One spinner process per CPU, pinned to it, at ``SCHED_IDLE`` (any other thread that becomes
runnable there preempts it at once, so it takes time from nobody; it only keeps the vCPU
running). Each sleeps in a blocking read of its pipe; ``until(t)`` wakes them to spin until the
monotonic clock reaches ``t`` (CLOCK_MONOTONIC is one clock for every process of the host),
``release()`` sends them back to sleep. A spinner whose control process is gone reads end-of-file
and exits; a window is never longer than the control asked for.

Threads that poll awake while spinners run must not ``sched_yield``: that hands their CPU to the
spinner for a whole slice (``events.affinity.poll_until`` yields only on a pinned thread).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import structlog

log = structlog.get_logger("control.keep_awake")

# The spinner: a separate interpreter (no GIL shared with the control), importing nothing of ours.
SPINNER = r"""
import os, select, struct, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
until = 0
while True:
    if time.monotonic_ns() < until and not select.select([0], [], [], 0)[0]:
        continue
    data = os.read(0, 8)
    if len(data) < 8:
        sys.exit(0)
    until = struct.unpack("<q", data)[0]
"""


class KeepAwake:
    """Spinners on ``cpus`` (default: every CPU this process may use), asleep until asked."""

    def __init__(self, cpus: list[int] | None = None):
        self.cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
        self._until = 0
        self._procs = [subprocess.Popen([sys.executable, "-c", SPINNER, str(cpu)], stdin=subprocess.PIPE,
                                        bufsize=0, close_fds=True) for cpu in self.cpus]
        self.windows = 0

    @property
    def awake_until(self) -> int:
        return self._until

    def until(self, until_ns: int) -> None:
        """Spin until ``until_ns`` (monotonic ns); a window already open is only ever lengthened."""
        if until_ns <= self._until:
            return
        if self._until <= time.monotonic_ns():
            self.windows += 1
        self._until = until_ns
        self._tell(until_ns)

    def release(self) -> None:
        """Back to sleep now (the window's move is done)."""
        if self._until > time.monotonic_ns():
            self._tell(0)
        self._until = 0

    def stop(self) -> None:
        for p in self._procs:
            try:
                p.stdin.close()                  # end-of-file: the spinner exits
            except OSError:
                pass
        for p in self._procs:
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2)
        self._procs = []

    def _tell(self, until_ns: int) -> None:
        data = struct.pack("<q", until_ns)
        gone = []
        for p in self._procs:
            try:
                os.write(p.stdin.fileno(), data)
            except OSError as e:         # a spinner died: the others go on, the host is only less awake
                log.warning("keep_awake_spinner_gone", pid=p.pid, returncode=p.poll(), error=str(e))
                gone.append(p)
        if gone:
            self._procs = [p for p in self._procs if p not in gone]
