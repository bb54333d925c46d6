"""What leaves one of a worker's sockets: a command's replies, recorded before they go, and the
reply fault hooks with their timers.

Each socket has one outbox, owned by the thread that owns the socket (the I/O thread's Hello
socket, the device thread's command socket). Replies are recorded in the ``WorkerRecord`` before
they are sent, so a duplicate command gets the same answer and ``QueryMoves`` knows the outcome.
A move's outcome may leave early, as soon as the mover has it and before the mover's own
bookkeeping after it (``send_early``); the rest of the command's replies follow when it returns.

The fault hooks (dataplane/faults.py) act here, on that one path: an outcome may be dropped,
held for a while (``tick`` sends it when due), sent twice, or held until the next one is sent.
"""
from __future__ import annotations

import heapq
import time

import msgspec
import structlog

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.transport import ControlLink
from residency.dataplane.worker import OUTCOMES, WorkerRecord, command_ref
from residency.events.codec import encode_message
from residency.events.commands import BlocksReleased, ExecuteMove, ReleaseBlocks

log = structlog.get_logger("dataplane.outbox")
MS = 1_000_000
REORDER_HOLD_MS = 500     # an outcome held back for the next one goes anyway after this long


class Outbox:
    """Replies out of one socket (not thread-safe: the socket's thread only)."""

    def __init__(self, link: ControlLink, record: WorkerRecord, faults: WorkerFaults):
        self.link, self.record, self.faults = link, record, faults
        self._delayed: list[tuple[int, int, bytes]] = []     # (due monotonic ns, n, payload)
        self._held: tuple[bytes, int] | None = None           # a reordered outcome and when it must go
        self._n = 0
        self.sent_ns = 0          # wall ns: the last outcome was handed to ZMQ (a bench's mark)

    def send(self, msg) -> None:
        self.link.send(msg)

    def resend(self, replies: list) -> None:
        """A duplicate command: the replies recorded for it, again."""
        for r in replies:
            self.link.send(r)

    def send_early(self, cmd: ExecuteMove, outcome) -> bool:
        """The mover has ``cmd``'s outcome and is yet to settle it: record and send it now, so the
        control's commit overlaps that bookkeeping. False: it could not, and goes with the rest."""
        try:
            self.record.note(cmd.move_id, [outcome], time.time_ns())
            self._send_outcome(encode_message(outcome))
        except Exception as e:  # noqa: BLE001 - then it goes the usual way, after the mover returns
            log.warning("early_ack_failed", move_id=cmd.move_id, error=repr(e))
            return False
        return True

    def deliver(self, cmd, replies: list, early=None) -> None:
        """Record ``cmd``'s replies (moves and releases), then send them. ``early``: its outcome,
        already sent by ``send_early``, not sent again (and kept first if the mover raised after it)."""
        if early is not None and early not in replies:
            replies = [early] + replies
        silent = False
        if type(cmd) is ReleaseBlocks and replies and type(replies[0]) is BlocksReleased:
            if self.faults.roll("zero_release"):
                replies = [msgspec.structs.replace(replies[0], bytes_freed=0)]
            silent = self.faults.roll("silent_release")
        if type(cmd) in (ExecuteMove, ReleaseBlocks):
            self.record.note(command_ref(cmd), replies, time.time_ns())
        if silent:
            log.warning("fault_silent_release", ref=command_ref(cmd))
            return
        for r in replies:
            if r is early:
                continue
            if isinstance(r, OUTCOMES):
                self._send_outcome(encode_message(r))
            else:
                self.link.send(r)

    def _send_outcome(self, payload: bytes) -> None:
        f = self.faults
        self.sent_ns = time.time_ns()
        if not f.enabled:
            self.link.send_bytes(payload)
            return
        now = time.monotonic_ns()
        if f.roll("drop_ack"):
            return
        delay = f.roll_delay_s()
        if delay:
            self._n += 1
            heapq.heappush(self._delayed, (now + int(delay * 1e9), self._n, payload))
            return
        if self._held is None and f.roll("reorder_ack"):
            self._held = (payload, now + REORDER_HOLD_MS * MS)
            return
        self.link.send_bytes(payload)
        if f.roll("duplicate_ack"):
            self.link.send_bytes(payload)
        if self._held is not None:
            self.link.send_bytes(self._held[0])
            self._held = None

    def timeout_ms(self, idle_ms: int) -> int:
        """How long the socket's thread may sleep in its poll: ``idle_ms``, or until a held outcome is due."""
        due = [self._delayed[0][0]] if self._delayed else []
        if self._held:
            due.append(self._held[1])
        if not due:
            return idle_ms
        return min(idle_ms, max(0, min(due) - time.monotonic_ns()) // MS)

    def tick(self) -> None:
        """Send the held outcomes whose time came."""
        if not self._delayed and self._held is None:
            return
        now = time.monotonic_ns()
        while self._delayed and self._delayed[0][0] <= now:
            self.link.send_bytes(heapq.heappop(self._delayed)[2])
        if self._held is not None and self._held[1] <= now:
            self.link.send_bytes(self._held[0])
            self._held = None
