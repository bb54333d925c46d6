"""The device thread: the only thread of a worker that touches the mover and the model.

It owns a socket of its own, the lane (a second DEALER, identity ``w<N>.lane``, announced in
Hello.lane): once its ``LaneHello`` arrived, the control sends the device's commands there
(control/links.py); they run here in arrival order and their replies leave from here, so a move's
command and its ack each skip a hand-over between the worker's threads. Commands the I/O thread
hands over (a control that never heard the LaneHello sends everything to the Hello socket) run
in the same order, and their replies go back to the I/O thread, which sends them.

    loop:  handed commands ─► run, replies handed back
           the lane ─► CommandAhead: the awake poll, an early start (dataplane/ahead.py)
                    ─► a move or a release: claimed in the record, run, replies out (dataplane/outbox.py)
                    ─► any other command with a handler: run, replies out
           nothing to read and serving has work ─► one step of it

A move's outcome leaves as soon as the mover has it (``Mover.on_outcome``), before the mover's
bookkeeping after it, so the control's commit overlaps that; and a move of several chunks says
``MoveNearlyDone`` before its last one, so the control stays awake for the ack.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import structlog
import zmq

from residency.dataplane.ahead import AheadWatch
from residency.dataplane.faults import WorkerFaults
from residency.dataplane.outbox import Outbox
from residency.dataplane.restore_pipeline import PASSES
from residency.dataplane.transport import UNEXPECTED, ControlLink, WorkerTransportError
from residency.dataplane.worker import WorkerCore, WorkerRecord, command_ref, run_guarded, step_guarded
from residency.events.commands import CommandAhead, ErrorReply, ExecuteMove, LaneHello, MoveNearlyDone, ReleaseBlocks

log = structlog.get_logger("dataplane.device_thread")
IDLE_POLL_MS = 100
KEPT_POLL_MS = 1          # while a kept restore lands (dataplane/restore_pipeline.py)
# A bench's instrument (bench/worker.py --report-timings): after a move or a release run from
# the lane, ``after_move(cmd, marks)`` gives the messages to send after its outcome. The marks
# are wall-clock ns, named as MoveTimed's fields: received (read off the socket), queued (claimed,
# about to run), engine_start / engine_end (the run; an early start's begin), sent (its outcome
# handed to ZMQ), ahead (the CommandAhead that began it was read; 0: none).
AfterMove = Callable[[object, dict[str, int]], list]
_SAY_HELLO = object()       # a job: send LaneHello (after each Hello, so a restarted control learns the lane)


class DeviceThread:
    """Runs the worker's commands on one thread with the lane; ``hand_back(cmd, replies)`` takes
    the replies of the commands the I/O thread handed over."""

    def __init__(self, *, core: WorkerCore, record: WorkerRecord, faults: WorkerFaults, ctx: zmq.Context,
                 endpoint: str, worker: int, epoch: int,
                 hand_back: Callable[[object, list], None], after_move: AfterMove | None = None,
                 key: bytes | None = None):
        self.core, self.record, self.faults = core, record, faults
        self.key = key                  # the run's peer key, proven in the lane's handshake
        self.after_move = after_move
        self.ctx, self.endpoint, self.worker, self.epoch = ctx, endpoint, worker, epoch
        self.hand_back = hand_back
        self.ahead = AheadWatch(core)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._loop, name="device", daemon=True)
        # turns of the loop, read by the I/O thread for its Pong: they stop while this thread is stuck
        self.num_turns = 0
        self.log = log.bind(worker=worker, epoch=epoch)

    # ------------------------------------------------------------------ called by the I/O thread
    def start(self) -> None:
        self._thread.start()

    def hand(self, cmd) -> None:
        """Run ``cmd`` in order with the lane's commands; its replies go to ``hand_back``."""
        self._put(cmd)

    def say_hello(self) -> None:
        self._put(_SAY_HELLO)

    def stop(self, timeout_s: float = 30) -> None:
        """Finish the command running, then stop."""
        self._put(None)
        self._thread.join(timeout=timeout_s)

    def _put(self, job) -> None:
        self._jobs.put(job)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass      # full: it wakes anyway

    # ------------------------------------------------------------------ the device thread
    def _loop(self) -> None:
        lane = ControlLink(self.ctx, self.endpoint, self.worker, lane=True, key=self.key)
        out = Outbox(lane, self.record, self.faults)
        move_ctx = getattr(self.core.mover, "ctx", None)      # a real mover's (a bench mover has none)
        if move_ctx is not None:
            move_ctx.on_nearly_done = lambda mid, left, eta_us: lane.send(
                MoveNearlyDone(move_id=mid, worker=self.worker, bytes_left=left, eta_us=eta_us))
        poller = zmq.Poller()
        poller.register(lane.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        kept = self.core.restores
        try:
            while self._run_jobs(out):
                self.num_turns += 1
                bg = self.core.background
                busy = bg is not None and bg[0]() and self.core.ahead is None
                # a kept restore is looked at every KEPT_POLL_MS while nothing else wakes the thread
                idle_ms = KEPT_POLL_MS if kept is not None and kept.kept else IDLE_POLL_MS
                if self.ahead.watching(busy):        # a command is on its way (CommandAhead)
                    ready = self.ahead.poll(poller, out.timeout_ms(idle_ms))
                else:
                    ready = dict(poller.poll(0 if busy else out.timeout_ms(idle_ms)))
                if self._wake_r in ready:
                    self._drain_wake()
                out.tick()
                ran = lane.sock in ready and self._read(lane, out)
                if busy and not ran:
                    self.faults.before_step()
                    replies = step_guarded(bg[1])
                    self._send_settled(out)          # a restore the step settled: its outcome before the tokens
                    for r in replies:
                        out.send(r)
                if kept is not None and kept.kept:
                    kept.poll()                      # landed: verified, committed and answered now
                self._send_settled(out)
        finally:
            if kept is not None:
                kept.settle_all()
                self._send_settled(out)
            self.core.drop_ahead("the device thread stopped")
            if move_ctx is not None:
                move_ctx.on_nearly_done = None
            lane.close()

    def _run_jobs(self, out: Outbox) -> bool:
        """What the I/O thread handed over, in order; False: stop."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            if job is _SAY_HELLO:
                out.send(LaneHello(worker=self.worker, epoch=self.epoch))
                continue
            self._settle_kept(out)       # a handed command finds every restore finished
            replies = run_guarded(job, self.core.run)
            if type(job) is ExecuteMove:
                self.faults.move_executed(job.move_id)
            self.hand_back(job, replies)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _read(self, lane: ControlLink, out: Outbox) -> bool:
        """Up to 64 commands off the lane (fewer if a job was handed over meanwhile); True: any."""
        ran = False
        for _ in range(64):
            recv_ns = time.time_ns()
            try:
                cmd = lane.recv()
            except zmq.Again:
                break
            except WorkerTransportError as e:
                self.log.warning("bad_control_message", error=e.name, detail=e.detail, lane=True)
                out.send(ErrorReply(error=e.name, detail=e.detail))
                continue
            ran = True
            self.on_command(out, cmd, recv_ns)
            if not self._jobs.empty():
                break
        return ran

    def on_command(self, out: Outbox, cmd, recv_ns: int = 0) -> None:
        """One command off the lane: a hint, a move or release (claimed in the record first), or
        any command with a handler; its replies leave through ``out``."""
        t = type(cmd)
        if t is CommandAhead:
            self.ahead.on_hint(cmd, recv_ns)
            return
        self.ahead.command_came()
        if t not in PASSES:
            self._settle_kept(out)       # only a Generate or a cancel runs before a kept restore is finished
        if t is ExecuteMove or t is ReleaseBlocks:
            ref = command_ref(cmd)
            verdict, replies = self.record.claim(ref)
            ahead = self.core.ahead
            if verdict != self.record.NEW and ahead is not None and ahead.move_id == ref:
                self.core.drop_ahead(f"its command was {verdict}")
            if verdict == self.record.DUPLICATE:       # the same answer again
                out.resend(replies)
                return
            if verdict == self.record.TOMBSTONED:
                self.log.warning("tombstoned_command_refused", ref=ref)
                out.deliver(cmd, self.record.refusal(cmd))
                return
            if verdict == self.record.RUNNING:
                return
            if self.after_move is not None:
                self._timed(out, cmd, recv_ns)
                return
        elif t is ErrorReply:     # e.g. unknown_worker from a restarted control: the I/O thread says Hello
            self.log.info("control_error_on_lane", error=cmd.error, detail=cmd.detail)
            return
        elif t not in self.core.handlers:
            out.send(ErrorReply(error=UNEXPECTED, detail=f"{t.__name__} has no handler on the device thread"))
            return
        replies, early = self._run_command(out, cmd)
        if t is ExecuteMove and self._kept(cmd.move_id):
            return                       # its outcome leaves when it is settled (_send_settled)
        out.deliver(cmd, replies, early)

    # ------------------------------------------------------------------ kept restores
    def _kept(self, move_id: str) -> bool:
        return self.core.restores is not None and self.core.restores.holds(move_id)

    def _settle_kept(self, out: Outbox) -> None:
        """Finish every kept restore and send its outcome (before a command that must see it finished)."""
        if self.core.restores is not None and self.core.restores.kept:
            self.core.restores.settle_all()
        self._send_settled(out)

    def _send_settled(self, out: Outbox) -> None:
        """The outcomes of the kept restores settled since the last call, each followed by what the
        serving loop answered to it (the sequences it failed)."""
        if self.core.restores is None:
            return
        for cmd, outcome, replies in self.core.restores.take():
            self.faults.move_executed(cmd.move_id)
            out.deliver(cmd, [outcome])
            for r in replies:
                out.send(r)

    def _run_command(self, out: Outbox, cmd) -> tuple[list, object]:
        """Run a command: its replies, and the outcome among them already sent (or None)."""
        if type(cmd) is ExecuteMove:
            return self._execute(out, cmd)
        return run_guarded(cmd, self.core.run), None

    def _execute(self, out: Outbox, cmd: ExecuteMove) -> tuple[list, object]:
        """Run a move; its outcome leaves the moment the mover has it (``on_outcome``, called
        before the mover's bookkeeping after the move), the rest when the mover returns."""
        mover = self.core.mover
        early: list = []          # the outcome sent early
        counted: list = []        # move_executed was called (once per move)

        def on_outcome(outcome) -> None:
            if counted or outcome.move_id != cmd.move_id:
                return
            counted.append(True)
            self.faults.move_executed(cmd.move_id)
            if out.send_early(cmd, outcome):
                early.append(outcome)

        hooked = hasattr(mover, "on_outcome")
        if hooked:
            mover.on_outcome = on_outcome
        self.core.may_keep = True         # its outcome leaves from here: a restore may be kept
        try:
            replies = run_guarded(cmd, self.core.run)
        finally:
            self.core.may_keep = False
            if hooked:
                mover.on_outcome = None
        if self._kept(cmd.move_id):
            return replies, None          # counted when its outcome is handed over
        if not counted:
            self.faults.move_executed(cmd.move_id)
        return replies, early[0] if early else None

    def _timed(self, out: Outbox, cmd, recv_ns: int) -> None:
        """A move or release run as ``on_command`` runs it, its marks then given to ``after_move``."""
        begun = self.core.ahead is not None and self.core.ahead == cmd
        marks = {"received_ns": recv_ns, "ahead_ns": self.ahead.hint_read_ns if begun else 0}
        marks["queued_ns"] = t0 = time.time_ns()
        replies, early = self._run_command(out, cmd)
        marks.update(engine_start_ns=self.core.ahead_ns if begun else t0, engine_end_ns=time.time_ns())
        out.deliver(cmd, replies, early)
        marks["sent_ns"] = out.sent_ns
        for msg in self.after_move(cmd, marks):
            out.send(msg)
