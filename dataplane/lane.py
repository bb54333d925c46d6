"""The engine lane: a worker's engine thread with a socket of its own (``WorkerProc``'s mixin).

The control process sends the engine's commands to the lane once its ``LaneHello`` arrived
(control/links.py); they run here in arrival order and their replies leave from here, so a move's
command and its ack each skip a hand-over between the worker's two threads (a wake of a sleeping
thread: ~0.1 ms each way on an idle host). The I/O thread keeps its own socket for Hello,
heartbeats, ``QueryMoves`` and ``Shutdown``, answered at once even mid-move; the record of what
ran (``WorkerRecord``) is shared between the two threads under its lock, so a command still
unread on the lane when a ``QueryMoves`` reports it unknown is refused when it is read.

A ``CommandAhead`` keeps the lane polling awake for the command it announces; when it carries
that command (a device <-> host copy), the lane begins the move at once (``WorkerCore.start_ahead``)
and, until the command itself comes, only enqueues its chunks and watches the socket: any other
command first, the command refused, or ``AHEAD_HOLD_MS`` without it, and the move is abandoned.

The fields it uses are ``WorkerProc``'s (dataplane/proc.py).
"""
from __future__ import annotations

import os
import queue
import time

import zmq

from residency.dataplane.transport import UNEXPECTED, ControlLink, WorkerTransportError
from residency.dataplane.worker import OUTCOMES, command_ref
from residency.events import affinity
from residency.events.codec import encode_message
from residency.events.commands import CommandAhead, ErrorReply, ExecuteMove, LaneHello, MoveNearlyDone, MoveTimed, ReleaseBlocks

AWAKE_MAX_US = 5000       # the longest a CommandAhead keeps the lane polling awake
# the longest an early-started move (a CommandAhead that carried its command) waits for that
# command before its copies are abandoned; meanwhile the engine thread does nothing else, as it
# would while running the move (a 2 GiB move's copies take ~40 ms on the H200)
AHEAD_HOLD_MS = 250


class EngineLane:
    """The engine thread's loop with a lane (a part of WorkerProc; engine thread only)."""

    def _lane_loop(self) -> None:
        """The engine thread with its own socket: commands from the lane run here and their replies
        leave from here. Commands the I/O thread hands over (a control that ignores the lane)
        still run in order, their replies sent from the I/O thread."""
        affinity.pin_this_thread(self.cpu)
        lane = ControlLink(self.ctx, self.endpoint, self.worker, lane=True)
        move_ctx = getattr(self.core.engine, "ctx", None)      # the real engine's (not nocopy's)
        if self.nearly_done and move_ctx is not None:
            move_ctx.on_nearly_done = lambda mid, left, eta_us: lane.send(
                MoveNearlyDone(move_id=mid, worker=self.worker, bytes_left=left, eta_us=eta_us))
        poller = zmq.Poller()
        poller.register(lane.sock, zmq.POLLIN)
        poller.register(self._engine_wake_r, zmq.POLLIN)
        try:
            while True:
                if self._lane_hello_due:
                    self._lane_hello_due = False
                    lane.send(LaneHello(worker=self.worker, epoch=self.epoch))
                while True:           # handed over by the I/O thread (None: stop)
                    try:
                        cmd = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if cmd is None:
                        return
                    self._run_handed(cmd)
                bg = self.core.background
                busy = bg is not None and bg[0]()
                if self.core.ahead is not None:   # an early start: its command is on its way
                    busy = False
                    ready = self._poll_ahead(poller)
                elif busy:
                    ready = dict(poller.poll(0))
                elif self._awake_until:           # a command is on its way (CommandAhead)
                    ready = self._poll_awake(poller)
                else:
                    ready = dict(poller.poll(100))
                if self._engine_wake_r in ready:
                    try:
                        while os.read(self._engine_wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                ran = False
                if lane.sock in ready:
                    for _ in range(64):
                        recv_ns = time.time_ns()
                        try:
                            cmd = lane.recv()
                        except zmq.Again:
                            break
                        except WorkerTransportError as e:
                            self.log.warning("bad_control_message", error=e.name, detail=e.detail, lane=True)
                            lane.send(ErrorReply(error=e.name, detail=e.detail))
                            continue
                        ran = True
                        self._lane_command(lane, cmd, recv_ns)
                        if self._lane_hello_due or not self._jobs.empty():
                            break
                if busy and not ran:
                    self._lane_background_step(lane, bg[1])
        finally:
            self.core.drop_ahead("the engine lane stopped")
            if move_ctx is not None:
                move_ctx.on_nearly_done = None
            lane.close()

    def _poll_awake(self, poller: zmq.Poller) -> dict:
        """Poll awake (``affinity.poll_until``) until something comes or the CommandAhead's time
        is up."""
        ready = affinity.poll_until(poller, self._awake_until, self.cpu is not None)
        if not ready:
            self._awake_until = 0
        return dict(ready)

    def _poll_ahead(self, poller: zmq.Poller) -> dict:
        """While an early-started move waits for its command: enqueue its next chunk (if any) and
        look at the socket without waiting; once all is enqueued, poll (awake first, as for any
        CommandAhead) until the command comes. Past ``AHEAD_HOLD_MS`` the move is abandoned."""
        now = time.monotonic_ns()
        if now >= self._ahead_until:
            self.core.drop_ahead(f"its command did not come within {AHEAD_HOLD_MS} ms")
            return dict(poller.poll(0))
        pump = getattr(self.core.engine, "pump", None)
        if pump is not None and pump():
            return dict(poller.poll(0))
        if self._awake_until:
            return self._poll_awake(poller)
        return dict(poller.poll(max(1, (self._ahead_until - now) // 1_000_000)))

    def _lane_command(self, lane: ControlLink, cmd, recv_ns: int) -> None:
        t = type(cmd)
        if t is CommandAhead:
            if self.awake_for_commands:
                self._awake_until = time.monotonic_ns() + min(AWAKE_MAX_US, cmd.within_us) * 1000
            if cmd.command is not None and self.start_ahead and self.core.ahead is None:
                if self.core.start_ahead(cmd.command):
                    self._ahead_until = time.monotonic_ns() + AHEAD_HOLD_MS * 1_000_000
                    self._ahead_read_ns = recv_ns
            return
        self._awake_until = 0
        ahead_ns = 0
        if t is ExecuteMove or t is ReleaseBlocks:
            ref = command_ref(cmd)
            verdict, replies = self.record.claim(ref)
            if verdict != self.record.NEW and self.core.ahead is not None and self.core.ahead.move_id == ref:
                self.core.drop_ahead(f"its command was {verdict}")
            elif self.core.ahead is not None and self.core.ahead == cmd:
                ahead_ns = self.core.ahead_ns
            if verdict == self.record.DUPLICATE:       # the same answer again
                for r in replies:
                    lane.send(r)
                return
            if verdict == self.record.TOMBSTONED:
                self.log.warning("tombstoned_command_refused", ref=ref)
                self._lane_deliver(lane, cmd, self.record.refusal(cmd))
                return
            if verdict == self.record.RUNNING:
                return
        elif t is ErrorReply:     # e.g. unknown_worker from a restarted control: the I/O thread says Hello
            self.log.info("control_error_on_lane", error=cmd.error, detail=cmd.detail)
            return
        elif t not in self.core.handlers:
            lane.send(ErrorReply(error=UNEXPECTED, detail=f"{t.__name__} has no handler on the engine lane"))
            return
        queued_ns = t0 = time.time_ns()
        engine, early = self.core.engine, []
        hooked = t is ExecuteMove and self.early_ack and hasattr(engine, "on_outcome")
        if hooked:
            engine.on_outcome = lambda outcome: self._send_early(lane, cmd, outcome, early)
        try:
            replies = self._run_core(cmd)
        finally:
            if hooked:
                engine.on_outcome = None
        t1 = time.time_ns()
        sent_ns = self._lane_deliver(lane, cmd, replies, early)
        if self.report_timings and t in (ExecuteMove, ReleaseBlocks):
            lane.send(MoveTimed(move_id=command_ref(cmd), worker=self.worker, received_ns=recv_ns, queued_ns=queued_ns,
                                engine_start_ns=ahead_ns or t0, engine_end_ns=t1, sent_ns=sent_ns,
                                ahead_ns=self._ahead_read_ns if ahead_ns else 0))

    def _send_early(self, lane: ControlLink, cmd: ExecuteMove, outcome, early: list) -> None:
        """The engine has the move's outcome and is yet to settle it: record and send it now, so
        the control's commit overlaps that bookkeeping. ``early`` gets (sent ns, outcome)."""
        if early or outcome.move_id != cmd.move_id:
            return
        try:
            self.record.note(cmd.move_id, [outcome], time.time_ns())
            payload = encode_message(outcome)
            sent_ns = time.time_ns()
            lane.send_bytes(payload)
        except Exception as e:  # noqa: BLE001 - then it goes the usual way, after the engine returns
            self.log.warning("early_ack_failed", move_id=cmd.move_id, error=repr(e))
            return
        early.append((sent_ns, outcome))

    def _lane_deliver(self, lane: ControlLink, cmd, replies: list, early: list | None = None) -> int:
        """Record (for QueryMoves and duplicates), then send; returns when the outcome went (ns).
        ``early``: the outcome the lane already sent (``_send_early``), not sent again."""
        sent_ns, skip = 0, None
        if early:
            (sent_ns, skip), = early
            if skip not in replies:          # the engine raised after it: the outcome stands, first
                replies = [skip] + replies
        if type(cmd) in (ExecuteMove, ReleaseBlocks):
            self.record.note(command_ref(cmd), replies, time.time_ns())
        for r in replies:
            if r is skip:
                continue
            if isinstance(r, OUTCOMES):
                payload = encode_message(r)
                sent_ns = time.time_ns()
                lane.send_bytes(payload)
            else:
                lane.send(r)
        return sent_ns

    def _lane_background_step(self, lane: ControlLink, step) -> None:
        for r in self._run_step(step):
            lane.send(r)
