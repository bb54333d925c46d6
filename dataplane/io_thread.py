"""The worker's I/O thread: its Hello socket to the control process.

It says Hello (and again when the control falls silent or says it does not know us), answers
``Ping`` and ``QueryMoves`` at once even while a large move runs, stops on ``Shutdown``, hands
the device's commands to the device thread and side commands to the side threads, and sends
the replies those threads hand back (``Mailbox``).

    control silent > control_silent_s ─► Hello again (a restarted control adopts us)
    control silent > orphan_exit_s    ─► stop (nobody will ever ask for our memory again)
"""
from __future__ import annotations

import os
import queue
import time

import structlog
import zmq

from residency.dataplane.device_thread import DeviceThread
from residency.dataplane.faults import WorkerFaults
from residency.dataplane.outbox import Outbox
from residency.dataplane.side import SideThreads
from residency.dataplane.transport import UNEXPECTED, ControlLink, WorkerTransportError, lane_identity_of
from residency.dataplane.worker import WorkerCore, WorkerRecord, command_ref
from residency.events.commands import (
    CommandAhead, ErrorReply, ExecuteMove, Hello, Ping, Pong, QueryMemory, QueryMoves, ReleaseBlocks, Shutdown,
)

log = structlog.get_logger("dataplane.io_thread")
MS = 1_000_000
IDLE_POLL_MS = 100
HELLO_AGAIN_MIN_MS = 200      # an unknown_worker answer is not met with a Hello more often than this


class Mailbox:
    """Replies made on other threads (device, side) for the I/O thread to send; ``fileno`` wakes its poll."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self._r

    def put(self, cmd, replies: list) -> None:
        self._items.put((cmd, replies))
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except OSError:
            pass      # the pipe is full: the I/O thread wakes anyway

    def take(self) -> list[tuple[object, list]]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._items.get_nowait())
            except queue.Empty:
                return out


class IOThread:
    """The Hello socket's side of a worker (main thread only, except ``stop``)."""

    def __init__(self, *, worker: int, epoch: int, device: str, block_bytes: int, ctx: zmq.Context, endpoint: str,
                 core: WorkerCore, record: WorkerRecord, faults: WorkerFaults, device_thread: DeviceThread,
                 side: SideThreads, mailbox: Mailbox, control_silent_s: float, orphan_exit_s: float,
                 key: bytes | None = None):
        self.worker, self.epoch, self.device, self.block_bytes = worker, epoch, device, block_bytes
        self.ctx, self.endpoint, self.key = ctx, endpoint, key
        self.core, self.record, self.faults = core, record, faults
        self.device_thread, self.side, self.mailbox = device_thread, side, mailbox
        self.control_silent_ns = int(control_silent_s * 1e9)
        self.orphan_exit_ns = int(orphan_exit_s * 1e9)
        self.stop_reason: str | None = None
        self._last_control_ns = time.monotonic_ns()
        self._last_hello_ns = 0
        self._silent_logged = False
        self.link: ControlLink | None = None
        self.out: Outbox | None = None
        self._poller = zmq.Poller()
        self.log = log.bind(worker=worker, epoch=epoch)

    def open(self) -> None:
        self.link = ControlLink(self.ctx, self.endpoint, self.worker, key=self.key)
        self.out = Outbox(self.link, self.record, self.faults)
        self._poller.register(self.link.sock, zmq.POLLIN)
        self._poller.register(self.mailbox.fileno(), zmq.POLLIN)
        self.hello()

    def close(self) -> None:
        self.link.close()

    def stop(self, reason: str) -> None:
        """Any thread (a signal handler too): the loop ends after its current step."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.mailbox.wake()

    def hello(self) -> None:
        self._last_hello_ns = time.monotonic_ns()
        books = self.core.books.hello_fields() if self.core.books is not None else {}
        pool_gen, readers = self.core.pool_status()
        self.link.send(Hello(worker=self.worker, epoch=self.epoch, device=self.device,
                             tiers=dict(self.core.mover.capacities()), block_bytes=self.block_bytes,
                             lane=lane_identity_of(self.worker).decode(), disk_blocks=list(self.core.unclaimed_disk),
                             pool_gen=pool_gen, readers=readers, **books, **self.core.group_fields))
        for msg in self.core.hello_extras():     # e.g. ServingReady: the control learns the model again
            self.link.send(msg)
        self.device_thread.say_hello()           # after each Hello the lane says it is up

    # ------------------------------------------------------------------ one turn of the loop
    def wait(self) -> bool:
        """Sleep until the socket or the mailbox has something, or a timer is due; True: the socket."""
        ready = dict(self._poller.poll(self.out.timeout_ms(IDLE_POLL_MS)))
        return self.link.sock in ready

    def send_handed_back(self) -> None:
        for cmd, replies in self.mailbox.take():
            self.out.deliver(cmd, replies)

    def read(self) -> None:
        for _ in range(1024):
            if not self._recv():
                return

    def tick(self) -> None:
        """Held outcomes whose time came; Hello again to a silent control; stop when it is gone."""
        self.out.tick()
        if self.core.books is not None:
            for change in self.core.books.take_changes():    # pinned grants made or given back since Hello
                self.link.send(change)
        now = time.monotonic_ns()
        silent = now - self._last_control_ns
        if silent > self.orphan_exit_ns:
            self.log.warning("control_gone", silent_ms=silent // MS)
            self.stop(f"control silent for {silent // MS} ms")
        elif silent > self.control_silent_ns:
            if not self._silent_logged:
                self._silent_logged = True
                self.log.warning("control_silent", silent_ms=silent // MS)
            if now - self._last_hello_ns > self.control_silent_ns:
                self.hello()

    # ------------------------------------------------------------------ what comes in
    def _recv(self) -> bool:
        try:
            cmd = self.link.recv()
        except zmq.Again:
            return False
        except WorkerTransportError as e:
            self.log.warning("bad_control_message", error=e.name, detail=e.detail)
            self.link.send(ErrorReply(error=e.name, detail=e.detail))
            return True
        self._last_control_ns = time.monotonic_ns()
        self._silent_logged = False
        t = type(cmd)
        if t is Ping:
            self.link.send(self._pong(cmd))
        elif t is QueryMoves:
            self.link.send(self.record.report(cmd.move_ids))
        elif t is QueryMemory:
            if self.core.books is None:
                self.link.send(ErrorReply(error=UNEXPECTED, detail="this worker keeps no memory books"))
            else:
                self.link.send(self.core.books.probe(cmd.nonce))
        elif t is Shutdown:
            self.log.info("shutdown_asked", reason=cmd.reason)
            self.stop(f"asked: {cmd.reason}")
        elif t is ErrorReply:
            self._on_error(cmd)
        elif t is CommandAhead:
            pass            # a hint for the device thread's lane; this thread has nothing to wait for
        elif t is ExecuteMove or t is ReleaseBlocks:
            self._claim(cmd)
        elif self.side.takes(t):
            self.side.put(cmd)
        elif t in self.core.handlers:
            self.device_thread.hand(cmd)
        else:
            self.link.send(ErrorReply(error=UNEXPECTED, detail=f"{t.__name__} has no handler on this worker"))
        return True

    def _pong(self, ping: Ping) -> Pong:
        """With the engine's progress when the worker serves: read from the device thread's
        counters without waiting for it (a stuck device thread must not silence the Pong)."""
        progress = self.core.progress
        steps, running = progress() if progress is not None else (None, 0)
        return Pong(worker=self.worker, nonce=ping.nonce, ts_ns=time.time_ns(), num_steps=steps,
                    num_running=running, num_turns=self.device_thread.num_turns)

    def _claim(self, cmd) -> None:
        ref = command_ref(cmd)
        verdict, replies = self.record.claim(ref)
        if verdict == self.record.DUPLICATE:     # a duplicate command: the same answer again
            self.out.resend(replies)
        elif verdict == self.record.TOMBSTONED:
            self.log.warning("tombstoned_command_refused", ref=ref)
            self.out.deliver(cmd, self.record.refusal(cmd))
        elif verdict == self.record.NEW:
            self.device_thread.hand(cmd)

    def _on_error(self, err: ErrorReply) -> None:
        if err.error == "unknown_worker":
            if time.monotonic_ns() - self._last_hello_ns > HELLO_AGAIN_MIN_MS * MS:
                self.log.info("control_does_not_know_us", detail=err.detail)
                self.hello()
        else:
            self.log.warning("control_error", error=err.error, detail=err.detail)
