"""What a ``CommandAhead`` asks of the device thread (events/commands.py says what the hint is).

A CommandAhead keeps the device thread polling awake for the command it announces, at most
``AWAKE_MAX_US``, so the command is read the moment it lands instead of after a long-idle thread
wakes. When it carries that command (a device <-> host copy), the move begins at once
(``WorkerCore.start_ahead``) and, until the command itself comes, the device thread only enqueues
its chunks and watches its socket: any other command first, the command refused, or
``AHEAD_HOLD_MS`` without it, and the move is abandoned (``WorkerCore.drop_ahead``).
"""
from __future__ import annotations

import time

import zmq

from residency.dataplane.polling import poll_until
from residency.dataplane.worker import WorkerCore
from residency.events.commands import CommandAhead

MS = 1_000_000
AWAKE_MAX_US = 5000       # the longest a CommandAhead keeps the device thread polling awake
# the longest an early-started move waits for its command before its copies are abandoned;
# meanwhile the device thread does nothing else, as it would while running the move (a large
# move's copies take tens of ms)
AHEAD_HOLD_MS = 250


class AheadWatch:
    """The awake poll and the hold of an early-started move (device thread only)."""

    def __init__(self, core: WorkerCore):
        self.core = core
        self.awake_until = 0            # monotonic ns: poll awake until then
        self.hold_until = 0             # monotonic ns: an early-started move is abandoned then
        self.hint_read_ns = 0           # wall ns: the CommandAhead that began it was read

    def on_hint(self, hint: CommandAhead, read_ns: int = 0) -> None:
        now = time.monotonic_ns()
        self.awake_until = now + min(AWAKE_MAX_US, hint.within_us) * 1000
        if hint.command is not None and self.core.ahead is None and self.core.start_ahead(hint.command):
            self.hold_until = now + AHEAD_HOLD_MS * MS
            self.hint_read_ns = read_ns

    def command_came(self) -> None:
        self.awake_until = 0

    def watching(self, busy: bool) -> bool:
        """Poll with ``poll``: a move waits for its command, or (unless serving has work to step,
        which polls without waiting anyway) a command is on its way."""
        return self.core.ahead is not None or (self.awake_until != 0 and not busy)

    def poll(self, poller: zmq.Poller, idle_ms: int) -> dict:
        """Poll for what the hint announced: while an early-started move waits for its command,
        enqueue its next chunk (if any) and look at the socket without waiting; once all is
        enqueued, poll awake (as for any CommandAhead), then sleeping at most ``idle_ms``, until
        the command comes. Past ``AHEAD_HOLD_MS`` the move is abandoned."""
        if self.core.ahead is None:
            return self._poll_awake(poller)
        now = time.monotonic_ns()
        if now >= self.hold_until:
            self.core.drop_ahead(f"its command did not come within {AHEAD_HOLD_MS} ms")
            return dict(poller.poll(0))
        pump = getattr(self.core.mover, "pump", None)
        if pump is not None and pump():
            return dict(poller.poll(0))
        if self.awake_until:
            return self._poll_awake(poller)
        return dict(poller.poll(max(1, min(idle_ms, (self.hold_until - now) // MS))))

    def _poll_awake(self, poller: zmq.Poller) -> dict:
        ready = poll_until(poller, self.awake_until)
        if not ready:
            self.awake_until = 0
        return dict(ready)
