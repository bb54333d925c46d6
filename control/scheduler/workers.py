"""The workers that serve a model, and the scheduler that plans for them.

The scheduler's page size and context come from the first worker that says ``ServingReady``, so
it is made then; until that, ``sched`` is None and requests are refused as "model loading". A
worker whose pages are another size is not served (its page ids would mean other tokens).
"""
from __future__ import annotations

import structlog

from residency.control.dial import ContextFloor
from residency.control.scheduler.config import SchedulerConfig
from residency.control.scheduler.core import Scheduler
from residency.control.scheduler.cost import CostModel
from residency.control.scheduler.port import ModelCard
from residency.control.scheduler.wedge import WedgeWatch
from residency.events.commands import ServingReady

log = structlog.get_logger("control.serving")


class ServingWorkers:
    def __init__(self, proc, cost: CostModel, *, restore_policy: str, share_prefixes: bool,
                 wedge: WedgeWatch | None = None):
        self.proc = proc
        self.cost = cost
        self.restore_policy = restore_policy
        self.share_prefixes = share_prefixes
        self.ready: dict[int, ServingReady] = {}
        self.sched: Scheduler | None = None
        self.wedge = wedge or WedgeWatch()      # which of them are up but make no progress
        # workers that serve no more, with the 503's code and message (a stopped group's leader);
        # replaced whole on the loop thread, read by the API's health
        self.closed: dict[int, tuple[str, str]] = {}

    def on_ready(self, link, msg: ServingReady) -> None:
        if self.sched is None:
            self.sched = Scheduler(SchedulerConfig(page_tokens=msg.page_tokens, max_context=msg.max_context,
                                                   restore_policy=self.restore_policy,
                                                   share_prefixes=self.share_prefixes), self.cost,
                                   allocate=self.proc.allocate_block_ids)
            self.sched.rebuild(self.proc.state)
        elif msg.page_tokens != self.sched.cfg.page_tokens:
            log.error("worker_page_size_mismatch", worker=link.worker, page_tokens=msg.page_tokens,
                      expected=self.sched.cfg.page_tokens)
            return
        self.ready[link.worker] = msg
        self.cost.observe_overlap([r.restore_overlap for r in self.ready.values()])
        # the dial rebinds every reader of the pool: the serving loop's join the worker's own
        link.pool_gen = msg.pool_gen
        link.readers = list(dict.fromkeys([*getattr(link, "readers", []), *msg.readers]))
        self.sched.set_max_seqs(link.worker, msg.max_seqs)
        log.info("serving_ready", worker=link.worker, model=msg.model, max_context=msg.max_context,
                 device_blocks=msg.device_blocks, max_seqs=msg.max_seqs)

    def alive(self) -> list[int]:
        """Workers that said ``ServingReady`` and that the folded state still counts alive."""
        return [w for w in self.ready if (ws := self.proc.state.workers.get(w)) is not None and ws.alive
                and w not in self.closed]

    def close(self, worker: int, code: str, message: str) -> None:
        """``worker`` serves no more: nothing is routed to it; requests are answered 503 ``code``."""
        self.closed = {**self.closed, worker: (code, message)}

    def refusal(self) -> tuple[str, str] | None:
        """(code, message) of a closed worker, when no worker is left to serve; else None."""
        return next(iter(self.closed.values()), None) if not self.alive() else None

    def unwedged(self, workers: list[int]) -> list[int]:
        """Those of ``workers`` not wedged, or all of them when every one is (a request then goes
        where it would and is refused there, retryable)."""
        return [w for w in workers if not self.wedge.is_wedged(w)] or workers

    def models(self) -> list[ModelCard]:
        """Read from the API thread: ``ready`` is copied before iterating, since the loop thread
        may add or drop a worker meanwhile."""
        seen: dict[str, ModelCard] = {}
        for r in list(self.ready.values()):
            seen.setdefault(r.model, ModelCard(id=r.model, max_context=r.max_context, created=0))
        return list(seen.values())

    def lost(self, worker: int) -> None:
        """The worker is gone: nothing more is routed to it."""
        self.ready.pop(worker, None)
        self.cost.observe_overlap([r.restore_overlap for r in self.ready.values()])

    def lost_pages(self, worker: int, kept: set[int]) -> None:
        """Cut each session of a lost worker at its first page that did not survive on disk."""
        if self.sched is None:
            return
        lost = {b for e in self.sched.sessions.values() if e.worker == worker for b in e.blocks} - kept
        self.sched.forget_blocks(worker, lost)

    def context_floor(self, worker: int) -> ContextFloor | None:
        """One sequence of the whole context of the longest model ``worker`` serves, in pages
        (None: it said no ServingReady). A follower rank has none: its leader's decides."""
        r = self.ready.get(worker)
        if r is None:
            return None
        return ContextFloor(max_context=max([r.max_context, *(m.max_context for m in r.models)]),
                            page_tokens=r.page_tokens)

    def blocks_in_use(self) -> dict[int, set[int]]:
        """Pages running requests read or write (the control process's policies leave them be)."""
        return self.sched.busy_blocks() if self.sched is not None else {}
