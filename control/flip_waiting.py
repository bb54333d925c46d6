"""Requests held for a model no worker serves now (the Flipper's gate; loop thread only).

A worker tokenizes with its resident model, so a request naming another model is held before it
is tokenized: it starts over (``begin``) once an alive worker serves its model, or is answered
503 after ``wait_ns`` naming what it waited for (the sleep, the flip, a model not resident). A
held request is in hand (``RequestTable``): a client that leaves cancels it, the drain at stop
counts it.
"""
from __future__ import annotations

import time
from typing import Callable

import structlog

from residency.events import catalog as ev

log = structlog.get_logger("control.flip")
S = 1_000_000_000


class HeldRequests:
    """The requests held for a model, in arrival order, and what each waits for."""

    def __init__(self, proc, requests, wait_s: float):
        self.proc = proc
        self.requests = requests          # RequestTable
        self.wait_ns = int(wait_s * S)
        self.held: list = []              # RequestState held for a model, in arrival order
        self.begin: Callable = lambda r: None         # Admission.begin: a released request starts over
        self.refuse: Callable = lambda r, status, code, message, retry_after_s=None: None
        self.left: Callable = lambda r: None          # a held request whose client went away (closed in the ledger)

    def __bool__(self) -> bool:
        return bool(self.held)

    def hold(self, r, code: str, reason: str, worker: int) -> None:
        """Hold ``r`` (once): recorded as queued, waiting for ``code: reason``."""
        if r.phase == "held":
            return
        r.phase, r.wait_since_ns = "held", time.monotonic_ns()
        self.held.append(r)
        self.requests.add(r)
        r.wait_code, r.wait_reason = code, reason
        self.proc.record(ev.RequestQueued(request_id=r.request_id, session=r.session, worker=worker, prompt_tokens=0,
                                          waiting_for=f"{code}: {reason}"), correlation=r.request_id)
        log.info("request_held_for_model", request_id=r.request_id, model=r.req.model, code=code)

    def backlog(self) -> dict[str, list[int]]:
        """model -> when each request held for it began to wait (monotonic ns)."""
        out: dict[str, list[int]] = {}
        for r in self.held:
            out.setdefault(r.req.model, []).append(r.wait_since_ns)
        return out

    def release(self, serving: Callable[[str], list[int]]) -> None:
        """Start over every held request whose model a worker serves now."""
        for r in list(self.held):
            if r.cancelled:
                self.held.remove(r)
                self.left(r)
            elif serving(r.req.model):
                self.held.remove(r)
                r.phase = "new"
                self.begin(r)

    def expire(self, now_ns: int, why: Callable[[str], tuple[str, str]]) -> None:
        """Answer 503 those that waited longer than ``wait_ns``, naming what they waited for."""
        for r in list(self.held):
            if r.cancelled or now_ns - r.wait_since_ns > self.wait_ns:
                self.held.remove(r)
                if r.cancelled:
                    self.left(r)
                    continue
                code, reason = why(r.req.model)
                self.refuse(r, 503, code, f"waited {self.wait_ns // S} s for {r.req.model!r}: {reason}",
                            retry_after_s=1)

    def stop(self, reason: str) -> None:
        for r in list(self.held):
            self.held.remove(r)
            self.refuse(r, 503, "server_stopped", f"the server stopped ({reason}) before {r.req.model!r} was served")


__all__ = ["HeldRequests"]
