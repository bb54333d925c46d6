"""GroupCommitWriter: many producers, one background thread, one transaction per batch.

    writer = GroupCommitWriter(store)
    fut = writer.submit(envelope, event)     # concurrent.futures.Future[int]: the seq, once committed
    writer.flush(); writer.close()

The thread takes whatever is queued (up to ``max_batch``) and, if the batch is not full, waits at
most ``max_delay_s`` after its first event for more, then appends it all in one transaction
(``LedgerStore.append``): one lock, one commit, one fsync for up to ``max_batch`` events. A
future resolves only after its commit, so "appended before the command is sent" (write-ahead)
means ``fut.result()`` before sending.

Back-pressure: when ``max_queue`` events are waiting, ``submit`` BLOCKS until there is room. It
never drops an event. Each wait is counted (``stats()["backpressure_waits"]``) and logged as
``ledger_backpressure`` (at most once a second, with the number of waits since the last line),
so a slow disk shows up as a metric and a log line, not as a silent loss or a hidden stall.

Failures: if a batch fails because one retried triple conflicts, its events are retried one by
one so only the offending future gets the LedgerConflict; the others still commit. Any other
failure (LedgerUnavailable, ...) is set on every future of the batch and logged once.
``durability`` is per writer, see ``ledger.backend`` for what each level means on each backend.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

import structlog

from residency.events import Envelope
from residency.events.catalog import EVENT_TYPES, Event
from residency.ledger.backend import DURABILITY
from residency.ledger.errors import LedgerConflict, LedgerError

log = structlog.get_logger("ledger.writer")
_EVENT_CLASSES = frozenset(EVENT_TYPES.values())


class GroupCommitWriter:
    def __init__(self, store, max_batch: int = 1000, max_delay_s: float = 0.002, max_queue: int = 100_000,
                 durability: str = "normal"):
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if max_batch < 1 or max_queue < 1 or max_delay_s < 0:
            raise ValueError("max_batch and max_queue must be >= 1 and max_delay_s >= 0")
        self._store = store
        self._max_batch = max_batch
        self._max_delay_s = max_delay_s
        self._max_queue = max_queue
        self._durability = durability
        # (envelope, event, future, submitted at perf_counter)
        self._queue: collections.deque[tuple[Envelope, Event, Future, float]] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight = 0              # events taken off the queue, not yet resolved
        self._closing = False
        self._batches = 0
        self._events = 0
        self._backpressure_waits = 0
        self._waits_unlogged = 0
        self._last_bp_log = 0.0
        self._max_lag_s = 0.0
        self._failed = 0
        self._thread = threading.Thread(target=self._run, name="ledger-group-commit", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producers
    def submit(self, envelope: Envelope, event: Event) -> "Future[int]":
        """Queue one event; the future resolves to its seq after commit (or to the LedgerError).

        Blocks while the queue is full (back-pressure). Raises LedgerError once the writer is closed.
        """
        if not isinstance(envelope, Envelope) or type(event) not in _EVENT_CLASSES:
            raise TypeError(f"submit takes (events.Envelope, an events.catalog event), got "
                            f"({type(envelope).__name__}, {type(event).__name__})")
        fut: Future[int] = Future()
        with self._cond:
            if self._closing:
                raise LedgerError("the ledger writer is closed")
            if len(self._queue) >= self._max_queue:
                self._note_backpressure()
                while len(self._queue) >= self._max_queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    raise LedgerError("the ledger writer closed while this event waited for queue room")
            self._queue.append((envelope, event, fut, time.perf_counter()))
            self._cond.notify_all()
        return fut

    def _note_backpressure(self) -> None:  # holds self._cond
        self._backpressure_waits += 1
        self._waits_unlogged += 1
        now = time.monotonic()
        if now - self._last_bp_log >= 1.0:
            log.warning("ledger_backpressure", queue_depth=len(self._queue), max_queue=self._max_queue,
                        waits=self._waits_unlogged, total_waits=self._backpressure_waits)
            self._last_bp_log = now
            self._waits_unlogged = 0

    def flush(self, timeout: float | None = None) -> None:
        """Block until every event submitted before this call is resolved (committed or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"ledger writer flush timed out with {len(self._queue)} queued")
                self._cond.wait(remaining)

    def close(self) -> None:
        """Commit everything queued, then stop the thread. Further submits raise LedgerError."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> "GroupCommitWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queue_depth": len(self._queue),
                "in_flight": self._in_flight,
                "batches": self._batches,
                "events": self._events,
                "failed": self._failed,
                "backpressure_waits": self._backpressure_waits,
                "max_lag_s": self._max_lag_s,
            }

    # ------------------------------------------------------------------ the thread
    def _take(self) -> list[tuple]:
        """Wait for a batch: up to max_batch events, at most max_delay_s after the first one arrived."""
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return []
            first_at = self._queue[0][3]
            while len(self._queue) < self._max_batch and not self._closing:
                remaining = first_at + self._max_delay_s - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            n = min(self._max_batch, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
            self._cond.notify_all()      # room for blocked submitters
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            try:
                outcomes: list[Any] = self._store.append([(b[0], b[1]) for b in batch], durability=self._durability)
            except LedgerConflict as e:   # one bad retry must not sink its neighbours
                outcomes = self._one_by_one(batch) if len(batch) > 1 else [e]
            except BaseException as e:  # noqa: BLE001 - unavailable, or a bug: it must reach the submitters
                log.error("ledger_batch_failed", num_events=len(batch), error=str(e), error_type=type(e).__name__)
                outcomes = [e] * len(batch)
            done = time.perf_counter()
            failed = 0
            for (_env, _ev, fut, at), outcome in zip(batch, outcomes):
                try:
                    if isinstance(outcome, BaseException):
                        failed += 1
                        fut.set_exception(outcome)
                    else:
                        fut.set_result(outcome)
                except InvalidStateError:   # the submitter cancelled it; the event is written anyway
                    pass
            with self._cond:
                self._batches += 1
                self._events += len(batch) - failed
                self._failed += failed
                self._max_lag_s = max(self._max_lag_s, done - batch[0][3])
                self._in_flight = 0
                self._cond.notify_all()

    def _one_by_one(self, batch: list[tuple]) -> list[Any]:
        out: list[Any] = []
        for env, ev, _fut, _at in batch:
            try:
                out.append(self._store.append([(env, ev)], durability=self._durability)[0])
            except LedgerError as e:
                log.error("ledger_append_rejected", producer=env.producer, epoch=env.epoch,
                          producer_seq=env.producer_seq, type=type(ev).__name__, error=str(e))
                out.append(e)
        return out
