"""The requests the control process has accepted and not finished, and those waiting for room.

Loop thread only, except ``num_accepted`` (a length read, for the drain at shutdown). A request is
in ``by_id`` from tokenizing to its last chunk; in ``waiting`` too while the scheduler answered
``Wait`` (in arrival order, the order they are retried in).
"""
from __future__ import annotations

import collections

from residency.control.scheduler.bridge import RequestState


class RequestTable:
    def __init__(self):
        self.by_id: dict[str, RequestState] = {}
        self.waiting: list[RequestState] = []

    def get(self, request_id: str) -> RequestState | None:
        return self.by_id.get(request_id)

    def add(self, r: RequestState) -> None:
        self.by_id[r.request_id] = r

    def wait(self, r: RequestState) -> None:
        self.waiting.append(r)

    def admitted(self, r: RequestState) -> None:
        """No longer waiting (it may never have waited)."""
        if r in self.waiting:
            self.waiting.remove(r)

    def forget(self, r: RequestState) -> None:
        r.phase = "done"
        self.by_id.pop(r.request_id, None)
        self.admitted(r)

    def on_worker(self, worker: int) -> list[RequestState]:
        return [r for r in self.by_id.values() if r.worker == worker]

    def load(self, but: RequestState | None = None) -> collections.Counter:
        """Requests in hand per worker (``but`` one being routed, which is counted nowhere yet)."""
        return collections.Counter(r.worker for r in self.by_id.values() if r is not but)

    def num_accepted(self) -> int:
        return len(self.by_id)

    def num_running(self) -> int:
        return sum(1 for r in self.by_id.values() if r.phase == "running")
