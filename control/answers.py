"""Who waits for an answer, and when it may leave: an answer goes once everything recorded for
its ask is committed (write-ahead for answers as for commands)."""
from __future__ import annotations

import collections
import time

from residency.control.moves import AskWaiter, MoveBook
from residency.control.probes import MoveTraces
from residency.control.recorder import Recorder

# after answering a thread of this process before an ack's fold, the loop steps off the GIL this
# long so that thread takes its answer first (see ``Answers.send_off_loop``)
ANSWER_YIELD_S = 50e-6


class Answers:
    """The askers whose events are recorded, each with the seq that must commit before it hears."""

    def __init__(self, recorder: Recorder, book: MoveBook, traces: MoveTraces, metrics: collections.Counter,
                 yield_min_blocks: int):
        self.recorder = recorder
        self.book = book
        self.traces = traces
        self.metrics = metrics
        self.yield_min_blocks = yield_min_blocks
        self._queue: collections.deque[tuple[int, AskWaiter]] = collections.deque()   # (seq needed, waiter)

    def after_commit(self, waiter: AskWaiter) -> None:
        """Answer once everything recorded for the ask is committed."""
        need = max((s for s, _ in waiter.events), default=0)
        if not waiter.wait and waiter.move_ids:      # answered once its MoveRequesteds are committed
            mine = set(waiter.move_ids)
            need = max([need] + [s for s, req in self.book.awaiting_commit if req.move_id in mine])
        self._queue.append((need, waiter))

    def send_committed(self, committed: int) -> bool:
        """Answer every asker whose events are committed through ``committed``; True when any."""
        q = self._queue
        acted = False
        while q and q[0][0] <= committed:
            self.send(q.popleft()[1])
            acted = True
        return acted

    def num_due(self, committed: int) -> int:
        return sum(1 for need, _ in self._queue if need <= committed)

    def send_off_loop(self, fold_blocks: int = 0) -> None:
        """Answer now the committed askers that are off the loop's thread (a socket, another
        thread's future); the others stay queued for ``send_committed``.

        NOTE: a thread of this process woken by its answer still needs the GIL, which the loop
        would hold through the fold that follows: after answering one, when that fold is of at
        least ``yield_min_blocks`` blocks, the loop sleeps ``ANSWER_YIELD_S`` so the asker takes
        its answer first (a 1024-block move's overhead is about a third lower). A small fold is
        quicker than the sleep (bench/RESULTS.md, control)."""
        committed, q = self.recorder.committed, self._queue
        if not any(need <= committed and w.off_loop for need, w in q):
            return
        later = [(need, w) for need, w in q if need > committed or not w.off_loop]
        now = [w for need, w in q if need <= committed and w.off_loop]
        q.clear()
        q.extend(later)
        for w in now:
            self.send(w)
        if fold_blocks >= self.yield_min_blocks and any(w.off_loop == "thread" for w in now):
            self.metrics["answer_yields"] += 1
            time.sleep(ANSWER_YIELD_S)

    def send_all(self) -> None:
        """At stop: every queued answer goes (the caller has flushed the writer)."""
        while self._queue:
            self.send(self._queue.popleft()[1])

    def send(self, waiter: AskWaiter) -> None:
        if self.traces.keep:
            for mid in waiter.move_ids:
                self.traces.mark(mid, "answered")
        waiter.events.sort(key=lambda p: p[0])
        waiter.answer(waiter.events, waiter.move_ids, None, "")
