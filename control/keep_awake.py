"""Keep the host's CPUs from halting while big moves come and go.

On a virtual machine's guest a thread woken on a halted vCPU takes a while to run, and a move
through the control process wakes one at every hop (the ask, the command, the ack, the answer:
each a ZMQ I/O thread and the thread that reads it). Kept from halting, the same hops cost a third
to a half (bench/zmq_wake.py; bench/control.py; bench/RESULTS.md). Such guests have no cpuidle
driver to tune, so this does what a guest's ``idle=poll`` would, but only while it pays:

One spinner process per CPU, pinned to it, at ``SCHED_IDLE`` (any other thread that becomes
runnable there preempts it at once: it takes no time from anybody, it only keeps the vCPU
running). Each sleeps in a blocking read of its pipe. The window's end (CLOCK_MONOTONIC ns, one
clock for every process of the host) sits in 8 bytes of shared memory that every spinner maps:
``until(t)`` writes it, and only when the spinners are asleep also a byte down each pipe to wake
them (a lengthened window costs a store, not 16 system calls); they spin while the clock is short
of it. ``end_at(t)`` moves the end either way. A spinner whose control process is gone reads
end-of-file once its window is over and exits; the memory is a file unlinked as soon as the
spinners have it.

Threads that poll awake while spinners run must not ``sched_yield``: that hands their CPU to the
spinner for a whole slice (``control.awake_poll.poll_until`` never yields).

``AwakeWhileMoving`` opens the window while a big move is in flight (the control's part of it).
"""
from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time

import structlog

log = structlog.get_logger("control.keep_awake")
_END = struct.Struct("<q")

# The spinner: a separate interpreter (no GIL shared with the control), importing nothing of ours.
SPINNER = r"""
import mmap, os, struct, sys, time
cpu, fd = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
end = mmap.mmap(fd, 8, prot=mmap.PROT_READ)
os.close(fd)
now, until = time.monotonic_ns, struct.Struct("<q").unpack_from
while os.read(0, 1):
    while True:
        t = until(end, 0)[0]
        if now() >= t and until(end, 0)[0] == t:    # read twice: never end on a store half-seen
            break
"""


class KeepAwake:
    """Spinners on ``cpus`` (default: every CPU this process may use), asleep until a window opens."""

    def __init__(self, cpus: list[int] | None = None):
        self.cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
        self._until = 0
        self.windows = 0
        fd, path = tempfile.mkstemp(prefix="residency-awake-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            os.write(fd, bytes(8))
            self._end = mmap.mmap(fd, 8)
            self._procs = [subprocess.Popen([sys.executable, "-c", SPINNER, str(cpu), str(fd)], stdin=subprocess.PIPE,
                                            bufsize=0, pass_fds=(fd,)) for cpu in self.cpus]
        finally:
            os.close(fd)
            os.unlink(path)

    @property
    def awake_until(self) -> int:
        return self._until

    def until(self, until_ns: int) -> None:
        """Keep awake until ``until_ns`` (monotonic ns) at least: opens a window, or lengthens it."""
        if until_ns <= self._until:
            return
        asleep = self._until <= time.monotonic_ns()
        self._set(until_ns)
        if asleep:
            self.windows += 1
            self._wake()

    def end_at(self, until_ns: int) -> None:
        """End the window at ``until_ns`` (0: now), sooner or later than it was to end."""
        if until_ns > self._until and until_ns > time.monotonic_ns():
            self.until(until_ns)
        else:
            self._set(until_ns)

    def stop(self) -> None:
        self._set(0)
        for p in self._procs:
            try:
                p.stdin.close()                  # end-of-file: the spinner exits
            except OSError:
                pass
        deadline = time.monotonic() + 2.0       # for all of them: a starved SCHED_IDLE one is killed
        for p in self._procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2)
        self._procs = []

    def _set(self, until_ns: int) -> None:
        # NOTE: one 8-byte copy, not struct.pack_into (which zeroes the field, then writes it a
        # byte at a time: a spinner reading meanwhile saw a window over and went to sleep)
        self._until = until_ns
        self._end[0:8] = _END.pack(until_ns)

    def _wake(self) -> None:
        gone = []
        for p in self._procs:
            try:
                os.write(p.stdin.fileno(), b"w")
            except OSError as e:         # a spinner died: the others go on, the host is only less awake
                log.warning("keep_awake_spinner_gone", pid=p.pid, returncode=p.poll(), error=str(e))
                gone.append(p)
        if gone:
            self._procs = [p for p in self._procs if p not in gone]


class AwakeWhileMoving:
    """Keeps the host awake (``spinners``) while a move of at least ``min_bytes`` is in flight,
    and ``linger_s`` after the last one is settled."""

    def __init__(self, spinners: KeepAwake, min_bytes: int, linger_s: float):
        self.spinners = spinners
        self.min_bytes = min_bytes
        self.linger_s = linger_s
        self.moving: set[str] = set()       # big moves in flight that keep the host awake

    def requested(self, move_id: str, nbytes: int) -> None:
        """Move ``move_id`` of ``nbytes`` is requested: if big, keep the host's CPUs from halting
        until it is settled, at most its bytes at 10 GB/s + 50 ms."""
        if nbytes >= self.min_bytes:
            self.moving.add(move_id)
            self.spinners.until(time.monotonic_ns() + int((nbytes / 10e9 + 0.05) * 1e9))

    def settled(self, move_id: str) -> None:
        """Once no big move is left, the CPUs may halt after the linger (the next big move of a
        burst then finds them awake, and its ask is not slowed by waking them)."""
        if self.moving:
            self.moving.discard(move_id)
            if not self.moving:
                self.spinners.end_at(time.monotonic_ns() + int(self.linger_s * 1e9))

    @property
    def awake(self) -> bool:
        """The spinners are spinning (a window open): a woken thread then runs at once."""
        return self.spinners.awake_until > time.monotonic_ns()

    def stop(self) -> None:
        self.spinners.stop()
