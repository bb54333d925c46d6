"""The worker's side threads: commands that read no engine state, run beside the engine thread
(``WorkerProc``'s mixin).

Tokenizing is the one today (``WorkerCore.side_handlers``, filled by serving_worker.attach): a
prompt is rendered, encoded and given its content keys without touching the pool, and a long one
takes a while (1.3 MB of text: ~0.5 s on this VM's CPUs). On the engine thread it held every running
sequence's next step for that long; here the engine keeps stepping, as the tokenizer lets go of the
GIL while it encodes a long text (``Tokenizer.encode``).

    I/O thread    a side command arrives (the control sends it to the Hello socket, never the lane)
                  ─► the side queue
    side threads  ``SIDE_THREADS`` of them take commands in arrival order; each runs one ─► its
                  replies go to the I/O thread, which sends them (a long one holds up one thread:
                  the next prompt is tokenized by another meanwhile)

A handler that raises is answered with an ``ErrorReply`` naming the command (``_run_core``); the
thread goes on.
"""
from __future__ import annotations

import queue
import threading

SIDE_THREADS = 2


class SideThreads:
    """The side threads of a WorkerProc (its ``core``, ``_run_core`` and ``_hand_back``)."""

    def _start_side(self) -> list[threading.Thread]:
        self._side_jobs: queue.SimpleQueue = queue.SimpleQueue()
        if not self.core.side_handlers:
            return []
        threads = [threading.Thread(target=self._side_loop, name=f"side-{i}", daemon=True) for i in range(SIDE_THREADS)]
        for t in threads:
            t.start()
        return threads

    def _to_side(self, cmd) -> None:
        self._side_jobs.put(cmd)

    def _stop_side(self, threads: list[threading.Thread]) -> None:
        for _ in threads:
            self._side_jobs.put(None)
        for t in threads:
            t.join(timeout=5)

    def _side_loop(self) -> None:
        while True:
            cmd = self._side_jobs.get()
            if cmd is None:
                return
            self._hand_back(cmd, self._run_core(cmd, self.core.side_handlers[type(cmd)]), None)
