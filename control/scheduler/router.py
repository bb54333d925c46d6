"""Which worker a request runs on: ``routing.py`` decides, the ``Router`` applies it on the loop
thread.

Twice per request: before tokenizing (its session's worker, else the least loaded), and once its
content keys are known (``route``): a request its session does not pin may move to the worker
whose sessions share the most of its opening pages; a request whose session began on another
worker while it was tokenized follows the session there. ``routed`` counts the decisions for
/metrics (``residency_requests_routed{reason}``).
"""
from __future__ import annotations

import collections
from typing import Callable

import structlog

from residency.control.policy.proposals import busy_blocks
from residency.control.scheduler import routing
from residency.control.scheduler.bridge import RequestState
from residency.control.scheduler.requests import RequestTable
from residency.control.scheduler.sharing import find_shared_prefix
from residency.control.scheduler.workers import ServingWorkers

log = structlog.get_logger("control.serving")


class Router:
    def __init__(self, proc, workers: ServingWorkers, requests: RequestTable, *, share_prefixes: bool):
        self.proc = proc
        self.workers = workers
        self.requests = requests
        self.share_prefixes = share_prefixes
        self.routed: collections.Counter = collections.Counter()    # reason a request runs where it does
        # the workers that serve a model now (the Flipper's: a worker's arena holds one model at a time)
        self.serving: Callable[[str | None], list[int]] | None = None

    def choose_worker(self, session: str | None, model: str | None = None) -> int | None:
        """Where a new request is tokenized: its session's worker, else the least loaded, of
        those serving ``model`` now."""
        alive = self.workers.alive() if self.serving is None else self.serving(model)
        sched = self.workers.sched
        if session is not None and sched is not None:
            entry = sched.sessions.get(session)
            if entry is not None and entry.worker in alive:
                return entry.worker
        return routing.by_load(self.workers.unwedged(alive), self.requests.load())

    def route(self, r: RequestState) -> None:
        """``r`` tokenized on ``r.worker``: where it runs (``r.worker``, ``r.routed_from`` if moved)."""
        alive = self.workers.alive() if self.serving is None else self.serving(r.req.model)
        entry = self.workers.sched.sessions.get(r.req.session) if r.req.session is not None else None
        if entry is not None:
            reason = "session"
            if entry.worker != r.worker and entry.worker in alive:
                r.routed_from, r.worker = r.worker, entry.worker
        else:
            reason = self._route_for_prefix(r, alive)
        self.routed[reason] += 1

    def _route_for_prefix(self, r: RequestState, alive: list[int]) -> str:
        ready = self.workers.ready
        here = ready[r.worker]
        # NOTE: pages are shared only between workers whose KV means the same tokens: the same
        # model weights and the same page size.
        same = [w for w in alive if (o := ready[w]).model_digest == here.model_digest
                and o.page_tokens == here.page_tokens]
        if not self.share_prefixes or not r.keys or len(same) < 2:
            return "load"
        sessions, state, moving = self.workers.sched.sessions.values(), self.proc.state, busy_blocks(self.proc.state)
        shared = {w: len(find_shared_prefix(sessions, state, w, exclude=None, prompt_keys=r.keys,
                                            prompt_tokens=len(r.token_ids), page_tokens=here.page_tokens,
                                            moving=moving.get(w, set()))[1]) for w in same}
        w = routing.by_prefix(r.worker, shared, self.requests.load(but=r))
        if w == r.worker:
            return "prefix" if shared[w] else "load"
        log.info("request_routed", request_id=r.request_id, worker=w, tokenized_on=r.worker,
                 shared_pages=shared[w], pages_here=shared[r.worker])
        r.routed_from, r.worker = r.worker, w
        return "prefix"
