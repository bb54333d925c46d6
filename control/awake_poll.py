"""Polling awake for an outcome that is about to come.

A worker sends ``MoveNearlyDone`` when a move of several pipelined chunks has all but its last
chunk across. Until its outcome comes (at most its ``bytes_left`` at 10 GB/s, capped by
``ack_spin_max_us``) the loop polls without sleeping, so the ack is read the moment it lands
instead of after a long-idle thread wakes (bench/zmq_wake.py); shortly before the worker's
estimate of the ack (``warm_lead_us``) it warms the ledger's write path, so the ack's commit does
not pay for the caches the idle wait cost (``LedgerStore.warm_writer``).
"""
from __future__ import annotations

import collections
import time

import zmq

from residency.events.commands import MoveNearlyDone
from residency.control.probes import MoveTraces
from residency.control.recorder import Recorder
from residency.control.state import State

MS = 1_000_000


def poll_until(poller: zmq.Poller, until_ns: int) -> list:
    """Poll without sleeping until something is ready or the monotonic clock reaches ``until_ns``
    (then []).

    NOTE: no ``sched_yield`` between polls: the loop thread is not pinned, so a yield would only
    hand its CPU to whatever else may run there -- with control/keep_awake.py's SCHED_IDLE
    spinners, to a spinner for a whole slice (bench/RESULTS.md, control: keep-awake)."""
    while True:
        ready = poller.poll(0)
        if ready or time.monotonic_ns() >= until_ns:
            return ready


class AwakePoll:
    """The moves whose outcome the loop stays awake for, and the writer warm-up before the next."""

    def __init__(self, state: State, recorder: Recorder, traces: MoveTraces, metrics: collections.Counter,
                 ack_spin_max_us: int, warm_lead_us: int):
        self.state = state
        self.recorder = recorder
        self.traces = traces
        self.metrics = metrics
        self.spin_max_ns = ack_spin_max_us * 1000
        self.warm_lead_ns = warm_lead_us * 1000
        self.until_by_move: dict[str, int] = {}   # move_id -> poll awake until (monotonic ns)
        self._warm_at = 0                          # monotonic ns: warm the ledger writer then (0: no)
        self._warm_bytes = 0                       # ... for an ack of about this many payload bytes
        self._warm_move = ""                       # ... of this move

    def on_nearly_done(self, link, msg: MoveNearlyDone) -> None:
        self.traces.mark(msg.move_id, "nearly_done")
        self.metrics["nearly_done_hints"] += 1
        if self.spin_max_ns and msg.move_id in self.state.inflight:
            now = time.monotonic_ns()
            until = now + min(self.spin_max_ns, msg.bytes_left // 10)    # 10 GB/s = 10 B/ns
            self.until_by_move[msg.move_id] = max(until, self.until_by_move.get(msg.move_id, 0))
            # its ack's commit comes next: warm the writer just before
            self._warm_at = now + max(1, msg.eta_us * 1000 - self.warm_lead_ns)
            self._warm_bytes = 8 * len(self.state.inflight[msg.move_id].blocks)   # its checksums
            self._warm_move = msg.move_id

    def outcome_came(self, move_id: str) -> None:
        """An outcome of the move came: no more polling awake for it."""
        if self.until_by_move:
            self.until_by_move.pop(move_id, None)

    def forget(self, move_id: str) -> None:
        """The move is settled: no more polling awake for it, nor warming the writer for its ack."""
        self.outcome_came(move_id)
        if self._warm_at and self._warm_move == move_id:    # its writer warm-up is moot now
            self._warm_at = 0

    def poll(self, poller: zmq.Poller, now: int, timeout_ms: int) -> dict | None:
        """Poll awake while an outcome is about to come, at most until the next timer; None when
        no such wait is on (then the caller sleeps in the poll as usual)."""
        if not self.until_by_move:
            return None
        self.until_by_move = {m: t for m, t in self.until_by_move.items() if t > now}
        if not self.until_by_move:
            self._warm_at = 0
            return None
        self.metrics["awake_polls"] += 1
        until = min(max(self.until_by_move.values()), now + timeout_ms * MS)
        if self._warm_at:               # the ledger writer is to be warmed before the ack comes
            ready = poll_until(poller, min(until, self._warm_at))
            if ready:
                return dict(ready)
            if time.monotonic_ns() >= self._warm_at:
                self._warm_at = 0
                if self.recorder.warm(self._warm_bytes):
                    self.metrics["writer_warm_ups"] += 1
                    self.traces.mark(self._warm_move, "warmed")
        return dict(poll_until(poller, until))
