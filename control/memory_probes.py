"""The memory ask: probe every joined worker (``QueryMemory``), then answer with the view
(control/memory.py) once each has answered or the probe's time is up. Loop thread only.

    AskMemory ─► QueryMemory{nonce} to each joined worker
    MemoryReport{nonce} ─► kept; all in ─► MemoryAnswer
    timeout ─► MemoryAnswer with the silent workers' probes unknown (None)
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import structlog

from residency.control.memory import memory_view, to_json
from residency.events.asks import AskMemory, MemoryAnswer
from residency.events.commands import MemoryReport, QueryMemory

log = structlog.get_logger("control.memory")
MS = 1_000_000


class _Pending:
    __slots__ = ("ask_id", "reply", "deadline_ns", "waiting", "reports")

    def __init__(self, ask_id: str, reply: Callable, deadline_ns: int, waiting: set[int]):
        self.ask_id, self.reply, self.deadline_ns, self.waiting = ask_id, reply, deadline_ns, waiting
        self.reports: dict[int, MemoryReport | None] = {}


class MemoryProbes:
    def __init__(self, state_of: Callable, workers, blocks_in_use: Callable[[], dict[int, set[int]]]):
        self.state_of = state_of          # the live State (read at answer time)
        self.workers = workers            # the WorkerRegistry: who is joined, how to send, their sizings
        self.blocks_in_use = blocks_in_use
        self._nonces = itertools.count(1)
        self._pending: dict[int, _Pending] = {}

    def begin(self, ask: AskMemory, reply: Callable) -> None:
        nonce = next(self._nonces)
        timeout_ms = max(1, min(ask.probe_timeout_ms, 30_000))
        p = _Pending(ask.ask_id, reply, time.monotonic_ns() + timeout_ms * MS, set())
        for w in list(self.workers.by_worker):
            if self.workers.send_to_worker(w, QueryMemory(nonce=nonce)):
                p.waiting.add(w)
        self._pending[nonce] = p
        if not p.waiting:
            self._finish(nonce)

    def on_report(self, link, msg: MemoryReport) -> None:
        p = self._pending.get(msg.nonce)
        if p is None or link.worker not in p.waiting:
            return          # late (answered already) or not asked
        p.waiting.discard(link.worker)
        p.reports[link.worker] = msg
        if not p.waiting:
            self._finish(msg.nonce)

    def tick(self, now_ns: int) -> None:
        for nonce, p in list(self._pending.items()):
            if now_ns > p.deadline_ns:
                log.info("memory_probe_timed_out", workers=sorted(p.waiting))
                self._finish(nonce)

    def _finish(self, nonce: int) -> None:
        p = self._pending.pop(nonce)
        try:
            busy = self.blocks_in_use()
        except Exception:  # noqa: BLE001 - hotness unknown: every resident page counts as hot
            log.warning("memory_hotness_unknown", exc_info=True)
            busy = None
        view = memory_view(self.state_of(), busy, p.reports, dict(self.workers.sizing))
        p.reply(MemoryAnswer(ask_id=p.ask_id, view=to_json(view)))
