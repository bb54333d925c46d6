"""The producer side of the ledger in the control process: fold now, commit at the end of the
loop's iteration (inline when the writer is idle, through the group-commit writer under load)."""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from typing import Callable

from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded
from residency.control.errors import LedgerDiverged
from residency.control.fold import fold
from residency.control.policy.recency import Recency
from residency.control.probes import ControlFaults
from residency.control.recovery import PRODUCER
from residency.control.state import State


class Recorder:
    """The producer side of the ledger: fold now, commit at the end of the loop's iteration.

        record(event)   folds it into the live state with the seq it will get; buffers it
                        (``fold_later``: buffers it now, folds it at ``fold_deferred`` -- for an
                        ack whose commit and answer go first, see MoveLifecycle._settle)
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
                 durability: str = "normal", inline_max: int = 1000):
        self.store = store
        self.writer = writer
        self.state = state
        self.recency = recency
        self.epoch = epoch
        self.faults = faults
        self.durability = durability
        self.inline_max = inline_max
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
        return seq

    def fold_deferred(self) -> list[Recorded]:
        """Fold the events recorded with ``fold_later``, in seq order; returns them."""
        done, self._unfolded = self._unfolded, []
        for rec, ts in done:
            self.recency.observe(self.state, rec.event, ts)
            fold(self.state, rec)
        return [rec for rec, _ in done]

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
