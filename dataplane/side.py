"""The worker's side threads: commands that read no mover or model state, run beside the device
thread.

Tokenizing is the one today (``WorkerCore.side_handlers``, filled by serving_worker.attach): a
prompt is rendered, encoded and given its content keys without touching the pool, and a long one
takes a while (a long text can take half a second). On the device thread it held every running
sequence's next step for that long; here the device thread keeps stepping, as the tokenizer lets
go of the GIL while it encodes a long text (``Tokenizer.encode``).

    I/O thread    a side command arrives (the control sends it to the Hello socket, never to the
                  device thread's socket) ─► ``SideThreads.put``
    side threads  ``SIDE_THREADS`` of them take commands in arrival order; each runs one ─► its
                  replies go to ``hand_back`` (the I/O thread sends them; a long one holds up one
                  thread: the next prompt is tokenized by another meanwhile)

A handler that raises is answered with an ``ErrorReply`` naming the command (``run_guarded``);
the thread goes on.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

SIDE_THREADS = 2


class SideThreads:
    """Threads that run the side handlers; their replies go to ``hand_back(cmd, replies)``."""

    def __init__(self, handlers: dict[type, Callable[[Any], list]],
                 run_guarded: Callable[[Any, Callable[[Any], list]], list],
                 hand_back: Callable[[Any, list], None]):
        self.handlers, self.run_guarded, self.hand_back = handlers, run_guarded, hand_back
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if not self.handlers:
            return
        self._threads = [threading.Thread(target=self._loop, name=f"side-{i}", daemon=True)
                         for i in range(SIDE_THREADS)]
        for t in self._threads:
            t.start()

    def takes(self, cmd_type: type) -> bool:
        return cmd_type in self.handlers

    def put(self, cmd) -> None:
        self._jobs.put(cmd)

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _loop(self) -> None:
        while True:
            cmd = self._jobs.get()
            if cmd is None:
                return
            self.hand_back(cmd, self.run_guarded(cmd, self.handlers[type(cmd)]))
