"""Which worker a request runs on (``routing.py`` decides; this applies it on the loop thread).

A mixin of ``ServingService``. Twice per request: before tokenizing (its session's worker, else
the least loaded), and once its content keys are known (``_route``): a request its session does
not pin may move to the worker whose sessions share the most of its opening pages; a request
whose session began on another worker while it was tokenized follows the session there.
``routed`` counts the decisions for /metrics (``residency_requests_routed{reason}``).
"""
from __future__ import annotations

import collections

import structlog

from residency.control.policy.proposals import busy_blocks
from residency.control.scheduler import routing
from residency.control.scheduler.sharing import find_shared_prefix

log = structlog.get_logger("control.serving")


class RoutingOps:
    routed: collections.Counter

    def _alive_workers(self) -> list[int]:
        return [w for w in self.ready if (ws := self.proc.state.workers.get(w)) is not None and ws.alive]

    def _load(self, but=None) -> collections.Counter:
        return collections.Counter(q.worker for q in self.pending.values() if q is not but)

    def _choose_worker(self, session: str | None) -> int | None:
        alive = self._alive_workers()
        if session is not None and self.sched is not None:
            entry = self.sched.sessions.get(session)
            if entry is not None and entry.worker in alive:
                return entry.worker
        return routing.by_load(alive, self._load())

    def _route(self, p) -> None:
        """``p`` tokenized on ``p.worker``: where it runs (``p.worker``, ``p.routed_from`` if moved)."""
        alive = self._alive_workers()
        entry = self.sched.sessions.get(p.req.session) if p.req.session is not None else None
        if entry is not None:
            reason = "session"
            if entry.worker != p.worker and entry.worker in alive:
                p.routed_from, p.worker = p.worker, entry.worker
        else:
            reason = self._route_for_prefix(p, alive)
        self.routed[reason] += 1

    def _route_for_prefix(self, p, alive: list[int]) -> str:
        here = self.ready[p.worker]
        same = [w for w in alive if (r := self.ready[w]).model_digest == here.model_digest
                and r.page_tokens == here.page_tokens]
        if not self.share_prefixes or not p.keys or len(same) < 2:
            return "load"
        sessions, state, moving = self.sched.sessions.values(), self.proc.state, busy_blocks(self.proc.state)
        shared = {w: len(find_shared_prefix(sessions, state, w, exclude=None, prompt_keys=p.keys,
                                            prompt_tokens=len(p.token_ids), page_tokens=here.page_tokens,
                                            moving=moving.get(w, set()))[1]) for w in same}
        w = routing.by_prefix(p.worker, shared, self._load(but=p))
        if w == p.worker:
            return "prefix" if shared[w] else "load"
        log.info("request_routed", request_id=p.request_id, worker=w, tokenized_on=p.worker,
                 shared_pages=shared[w], pages_here=shared[p.worker])
        p.routed_from, p.worker = p.worker, w
        return "prefix"
