"""The producer side of the ledger in the control process: fold now, commit at the end of the
loop's iteration (inline when the writer is idle, through the group-commit writer under load);
and the checkpoints (a StateCheckpoint now and then, a snapshot once it is committed)."""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded
from residency.control.errors import LedgerDiverged
from residency.control.fold import fold
from residency.control.policy.recency import Recency
from residency.control.probes import ControlFaults
from residency.control.recovery import PRODUCER
from residency.control.state import State, encode_state, state_hash

log = structlog.get_logger("control.recorder")
Listener = Callable[[int, ev.Event], None]


class Recorder:
    """The producer side of the ledger: fold now, commit at the end of the loop's iteration.

        record(event)   folds it into the live state with the seq it will get, tells the
                        listeners, buffers it (``fold_later``: buffers it now, folds it and tells
                        at ``fold_deferred`` -- for an ack whose commit and answer go first, see
                        MoveDispatcher.settle)
        flush()         writer idle (nothing of ours committing): append the buffer here, in one
                        transaction, now -- the lowest latency for a lone move;
                        otherwise hand it to the group-commit writer's thread, whose next batch
                        takes it -- commits overlap with the loop's own work under load
        advance()       settle the writer's futures in order; the highest committed seq

    NOTE: both paths keep seq order: the inline path is taken only when no writer future of ours
    is unresolved, and only this thread records. Folds keep seq order too: a record that folds at
    once first folds whatever waits in ``fold_deferred``.
    """

    def __init__(self, store, writer, state: State, recency: Recency, epoch: int, faults: ControlFaults,
                 durability: str = "normal", inline_max: int = 1000, listeners: list[Listener] | None = None,
                 metrics: collections.Counter | None = None):
        self.store = store
        self.writer = writer
        self.state = state
        self.recency = recency
        self.epoch = epoch
        self.faults = faults
        self.durability = durability
        self.inline_max = inline_max
        self.listeners = listeners if listeners is not None else []
        self.metrics = metrics if metrics is not None else collections.Counter()
        self.producer_seq = 0
        self.next_seq = state.last_seq + 1
        self.committed = state.last_seq
        self._buffer: list[tuple[Envelope, ev.Event]] = []
        self._pending: collections.deque[tuple[int, Future, int]] = collections.deque()
        self._armed: Future | None = None
        self._unfolded: list[tuple[Recorded, int]] = []       # recorded, not folded yet (ts for recency)
        self._inline_since = 0
        self.num_inline = self.num_handed = 0

    def record(self, event: ev.Event, correlation: str | None = None, causation: str | None = None,
               fold_later: bool = False) -> int:
        """Fold ``event`` into the live state and queue it for the ledger; returns its seq. It is
        committed by the end of this loop iteration (or handed to the group-commit writer, when
        commits are already in flight). ``fold_later``: folded (and the listeners told) at
        ``fold_deferred``, which the caller runs before its handler returns."""
        self.metrics[f"recorded_{type(event).__name__}"] += 1
        ts = time.time_ns()
        self.producer_seq += 1
        seq = self.next_seq
        self.next_seq += 1
        env = Envelope(producer=PRODUCER, epoch=self.epoch, producer_seq=self.producer_seq, ts_ns=ts,
                       correlation_id=correlation, causation=causation, seq=seq)
        if fold_later:
            self._unfolded.append((Recorded(env, event), ts))
        else:
            if self._unfolded:
                self.fold_deferred()
            self.recency.observe(self.state, event, ts)
            fold(self.state, Recorded(env, event))
        self._buffer.append((env, event))
        self.faults.hit("crash_after_events")
        if not fold_later:
            self._tell(seq, event)
        return seq

    def fold_deferred(self) -> None:
        """Fold the events recorded with ``fold_later``, in seq order, and tell the listeners."""
        done, self._unfolded = self._unfolded, []
        for rec, ts in done:
            self.recency.observe(self.state, rec.event, ts)
            fold(self.state, rec)
        for rec, _ in done:
            self._tell(rec.envelope.seq, rec.event)

    def _tell(self, seq: int, event: ev.Event) -> None:
        for listener in self.listeners:
            try:
                listener(seq, event)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the ledger's writer
                log.exception("listener_failed", listener=getattr(listener, "__qualname__", repr(listener)))

    @property
    def unfolded(self) -> bool:
        return bool(self._unfolded)

    def warm(self, payload_bytes: int = 0) -> bool:
        """Warm the store's write path for an append of about ``payload_bytes`` expected soon
        (``LedgerStore.warm_writer``), when nothing of ours is committing or waiting to; True if
        it did."""
        warm = getattr(self.store, "warm_writer", None)
        if warm is None or self._pending or self._buffer:
            return False
        return warm(self.durability, payload_bytes)

    @property
    def commits_inline(self) -> bool:
        """A flush now commits on this thread, at once (no commit of ours is in flight)."""
        return not self._pending

    def flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        if not self._pending and len(batch) <= self.inline_max:
            self._inline_since = time.monotonic_ns()
            try:
                seqs = self.store.append(batch, durability=self.durability)
            finally:
                self._inline_since = 0
            if seqs[0] != batch[0][0].seq or seqs[-1] != batch[-1][0].seq:
                raise LedgerDiverged(f"events folded as seqs {batch[0][0].seq}..{batch[-1][0].seq} were committed "
                                     f"as {seqs[0]}..{seqs[-1]}: another writer appended to this ledger")
            self.committed = seqs[-1]
            self.num_inline += 1
            return
        now = time.monotonic_ns()
        for env, event in batch:
            # NOTE: blocks while the writer's queue is full (back-pressure: its log line and
            # stats say so, and health() reports the loop stalled).
            self._pending.append((env.seq, self.writer.submit(env, event), now))
        self.num_handed += 1

    def advance(self) -> int:
        """Settle committed futures in order; raises the ledger's error or LedgerDiverged."""
        q = self._pending
        while q and q[0][1].done():
            seq, fut, _ = q.popleft()
            got = fut.result()
            if got != seq:
                raise LedgerDiverged(f"event folded as seq {seq} was committed as seq {got}: "
                                     "another writer appended to this ledger")
            self.committed = seq
        return self.committed

    def arm(self, wake: Callable[[], None]) -> None:
        """Wake the loop when everything handed over so far has committed (commits are in order)."""
        if self._pending and self._pending[-1][1] is not self._armed:
            self._armed = self._pending[-1][1]
            self._armed.add_done_callback(lambda _f: wake())

    def lag_ns(self, now_ns: int) -> int:
        """How long the oldest uncommitted event of ours has waited (inline commit included)."""
        oldest = [t for t in (self._inline_since, self._pending[0][2] if self._pending else 0) if t]
        return now_ns - min(oldest) if oldest else 0

    @property
    def uncommitted(self) -> int:
        return len(self._pending) + len(self._buffer)

    @property
    def num_buffered(self) -> int:
        """Events recorded and not yet flushed (committed inline or handed to the writer)."""
        return len(self._buffer)


class Checkpoints:
    """A StateCheckpoint (the state's hash, for audits and replays to compare) every
    ``every_events`` events or ``every_s`` seconds; a snapshot of the state every
    ``snapshot_every_events``, saved once the checkpoint that names it has committed."""

    def __init__(self, store, state: State, recency: Recency, recorder: Recorder, every_events: int, every_s: float,
                 snapshot_every_events: int, last_snapshot_seq: int, now_ns: int):
        self.store = store
        self.state = state
        self.recency = recency
        self.recorder = recorder
        self.every_events = every_events
        self.every_ns = int(every_s * 1e9)
        self.snapshot_every_events = snapshot_every_events
        self.last_snapshot_seq = last_snapshot_seq
        self.last_seq = recorder.producer_seq     # producer seq of the last checkpoint ...
        self.last_at = now_ns                     # ... and when it was taken (monotonic ns)
        # (through seq, state bytes, hash, seq of the StateCheckpoint that records the hash) to save
        self._snapshot: tuple[int, bytes, str, int] | None = None

    def due(self, now_ns: int, quiet: bool) -> str:
        """"now", "quiet" (due by time: at the next iteration that sent and answered nothing,
        one period late at most) or "" (not due). One due by its event count never waits."""
        if self.recorder.producer_seq <= self.last_seq:
            return ""
        if self.recorder.producer_seq - self.last_seq >= self.every_events:
            return "now"
        if now_ns - self.last_at < self.every_ns:
            return ""
        return "now" if quiet or now_ns - self.last_at >= 2 * self.every_ns else "quiet"

    def take(self, now_ns: int) -> None:
        through = self.state.last_seq
        digest = state_hash(self.state)
        snap = None
        if through - self.last_snapshot_seq >= self.snapshot_every_events and self._snapshot is None:
            snap = encode_state(self.state)          # before the checkpoint below is folded into it
        checkpoint_seq = self.recorder.record(ev.StateCheckpoint(through_seq=through, state_hash=digest))
        if snap is not None:
            # the snapshot is only ever used with the checkpoint that vouches for it (ledger.snapshots)
            self._snapshot = (through, snap, digest, checkpoint_seq)
        self.last_seq, self.last_at = self.recorder.producer_seq, now_ns
        self.recency.prune(self.state)

    def save_committed(self, committed: int) -> None:
        """Save the pending snapshot once what it holds, and its checkpoint, are committed."""
        if self._snapshot is not None and self._snapshot[3] <= committed:
            through, data, digest, checkpoint_seq = self._snapshot
            self._snapshot = None
            self.store.save_snapshot(through, data, digest, checkpoint_seq)
            self.last_snapshot_seq = through
            log.info("snapshot_saved", through_seq=through, bytes=len(data))
