"""``ServingService``: the control process's side of inference; it serves the ``Backend`` port.

Everything that decides or records runs on the control loop thread (handlers of worker messages,
``proc.call``), where the folded state is consistent; the API's coroutines only post work there
and await the answer (``bridge``). The pure decisions are ``Scheduler``'s. The service is the
thin shell that wires the parts and carries the port's calls to them:

    ServingWorkers     who serves a model; the Scheduler, made on the first ServingReady
    RequestTable       requests accepted and not finished, and those waiting for room
    Router             which worker a request runs on
    Admission          tokenize, plan, wait, restore, run            (Tokenized)
    GenerationStreams  tokens to the stream, the end of a request    (TokensGenerated)
    SessionBook        sessions by hand, the retention budget        (the admin routes)
    ServingStats       moves counted, the /metrics snapshot          (every recorded event)
    Asker              moves and releases asked of the control process
    WedgeWatch         workers that answer pings but make no step (Pong, StepCompleted)
    Flipper            sleep, wake and model flips; requests held for a model (WeightsSwapped)

A request, as the ledger sees it:

    Tokenize ─► Tokenized ─► plan ─► Refuse: RequestRefused                      (HTTP 400/409/503)
                                 ─► Wait:   parks of idle sessions, retried when room appears
                                 ─► Admit:  RequestAdmitted (with the donor of a shared prefix, if any)
                                            [release superseded pages]  MoveRequested(evict, T→T) …
                                            [restore the prefix]        MoveRequested(restore) … MoveAcked,
                                                                        SessionRestored (the donor's, if shared)
                                            Generate ─► TokensGenerated …  BlocksCommitted (as pages fill)
                                            last TokensGenerated ─►       BlocksFreed(finished|disconnected|error)
                                                                          RequestFinished
"""
from __future__ import annotations

import asyncio
import threading
import time

import structlog

from residency.events.asks import AskMemory, MemoryAnswer
from residency.control.scheduler.admission import Admission
from residency.control.scheduler.asker import TERMINAL, Asker
from residency.control.scheduler.bridge import RequestState, Stream
from residency.control.scheduler.cost import CostModel
from residency.control.scheduler.groups import GroupServing
from residency.control.scheduler.reclaimer import Reclaimer, dial_of
from residency.control.scheduler.port import BackendError, BackendStats, GenerateRequest, Health, ModelCard, SessionInfo
from residency.control.scheduler.requests import RequestTable
from residency.control.scheduler.router import Router
from residency.control.scheduler.session_book import SessionBook
from residency.control.scheduler.stats import ServingStats
from residency.control.scheduler.streams import GenerationStreams
from residency.control.scheduler.wedge import DEFAULT_FLOOR_S, WedgeWatch
from residency.control.flip_policy import FlipPolicyConfig
from residency.control.flipping import Flipper
from residency.control.scheduler.workers import ServingWorkers
from residency.events import catalog as ev
from residency.events.asks import AskFlip, AskReclaim, AskReleaseTenant
from residency.events.commands import Pong, ServingReady, Tokenized, TokensGenerated, WeightsSwapped

log = structlog.get_logger("control.serving")
PRUNE_EVERY_NS = 60 * 10**9           # how often sessions that hold nothing are looked for
PRUNE_IDLE_NS = 600 * 10**9           # a session that holds nothing is forgotten after this long idle


class ServingService:
    def __init__(self, proc, *, restore_policy: str = "cost", share_prefixes: bool = True, retain_fraction: float = 0.0,
                 cost: CostModel | None = None, wait_timeout_s: float = 120.0, max_waiting: int = 256,
                 tick_s: float = 0.25, api_timeout_s: float = 600.0, default_max_tokens: int | None = None,
                 wedged_after_s: float = DEFAULT_FLOOR_S, tenants: dict | None = None,
                 flip_wait_s: float = 60.0, flip_drain_s: float = 30.0, flip_policy: FlipPolicyConfig | None = None):
        self.proc = proc
        self.api_timeout_s = api_timeout_s
        self.cost = cost or CostModel()
        self.workers = ServingWorkers(proc, self.cost, restore_policy=restore_policy, share_prefixes=share_prefixes,
                                      wedge=WedgeWatch(floor_s=wedged_after_s))
        self.requests = RequestTable()
        self.router = Router(proc, self.workers, self.requests, share_prefixes=share_prefixes)
        self.asker = Asker(proc)
        self.book = SessionBook(proc, self.workers, self.asker, retain_fraction=retain_fraction)
        self.admission = Admission(proc, self.workers, self.requests, self.router, self.asker,
                                   retain_fraction=retain_fraction, max_waiting=max_waiting,
                                   wait_timeout_s=wait_timeout_s, default_max_tokens=default_max_tokens)
        self.streams = GenerationStreams(proc, self.workers, self.requests, self.admission, self.book)
        self.serving_stats = ServingStats(proc, self.cost, self.workers, self.requests, self.router,
                                          restores=self.admission.restores)
        # outside tenants' reclaims and releases (serve --tenant); the dial is given to it by serve
        self.reclaimer = Reclaimer(proc, self.workers, self.asker, tenants or {})
        self.reclaimer.dial = dial_of(proc)
        proc.on_ask(AskReclaim, self.reclaimer.on_reclaim)
        proc.on_ask(AskReleaseTenant, self.reclaimer.on_release)
        # sleep, wake and flips of the weights arena; requests for a model not resident wait there
        self.flips = Flipper(proc, self.workers, self.requests, self.asker, wait_s=flip_wait_s, drain_s=flip_drain_s,
                             policy=flip_policy or FlipPolicyConfig())
        held = self.flips.waiting
        held.begin, held.refuse, self.flips.changed = self.admission.begin, self.admission.refuse, self.admission.retry_soon
        self.admission.gate, self.admission.flip_holds = self.flips.gate, self.flips.holds
        self.admission.held_tokenized, held.check = held.on_tokenized, self.admission.check
        held.left = lambda r: self.admission.end_waiting(
            r, r.cancelled or "disconnected", BackendError(499, "the client went away", code="client_disconnected"),
            client_left=True)
        self.router.serving = self.flips.serving
        proc.on_ask(AskFlip, self.flips.on_ask)
        self.draining = False             # set by drain(): new requests are refused
        self._last_stats = BackendStats()  # what /metrics shows again while the loop cannot answer
        self._last_prune_ns = 0
        self._wedged: dict[int, ev.WorkerWedged] = {}    # replaced whole on the loop thread, read by health()
        self._stop = threading.Event()
        for msg_type, handler in ((ServingReady, self.on_ready), (Tokenized, self.admission.on_tokenized),
                                  (WeightsSwapped, self.flips.on_swapped),
                                  (TokensGenerated, self.streams.on_tokens), (ev.StepCompleted, self.on_step),
                                  (Pong, self._on_pong), (ev.ExpertsMoved, self._on_experts)):
            proc.on_worker_message(msg_type, handler)
        proc.add_listener(self._on_recorded)
        proc.add_pool_reader("scheduler", self._pool_view)
        proc.add_stop_hook(self.admission.stop_waiting)
        proc.add_stop_hook(self.streams.stop)
        proc.add_stop_hook(self.flips.stop)
        proc.blocks_in_use = self.workers.blocks_in_use
        proc.context_of = self.workers.context_floor
        proc.worker_gone = self._on_worker_gone
        book = getattr(proc, "groups", None)
        # serve --tp N: the leader served, every rank accounted and compared (its handlers replace those above)
        self.groups = GroupServing(proc, self, book) if book is not None else None
        if book is not None:        # a group's weights flip, sleep and wake on every rank at once
            self.flips.ranks_of = lambda w: book.members.get(book.group_of.get(w), [])
            self.flips.stop_group = self.groups.stop_of
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,), name="serving-tick", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stop.set()

    # ================================================================== the port (API thread)
    def models(self) -> list[ModelCard]:
        return list(self.flips.cards) or self.workers.models()

    def sleeping(self) -> bool:
        """Whether a worker's weights arena sleeps (``GET /is_sleeping``)."""
        return self.flips.sleeping

    def drain(self) -> None:
        """The server is stopping: refuse new requests (503), let those accepted finish."""
        self.draining = True

    def num_pending(self) -> int:
        """Requests accepted and not finished (tokenizing, waiting, restoring or running)."""
        return self.requests.num_accepted()

    async def submit(self, req: GenerateRequest) -> Stream:
        if self.draining:
            raise BackendError(503, "the server is shutting down; send the request to another instance",
                               type="server_error", code="server_shutting_down")
        r = RequestState(req, asyncio.get_running_loop())
        self.proc.call(lambda _proc: self.admission.begin(r))
        try:
            await asyncio.wait_for(asyncio.shield(r.admitted), self.api_timeout_s)
        except asyncio.TimeoutError:
            self._post_cancel(req.request_id, "timeout")
            raise BackendError(503, "the control process did not admit the request in time", type="server_error",
                               code="admission_timeout") from None
        except asyncio.CancelledError:
            self._post_cancel(req.request_id, "disconnected")
            raise
        return Stream(r, self._post_cancel)

    async def park(self, session: str, tier: str = "host") -> SessionInfo:
        return await self._on_loop(lambda done: self.book.park(session, tier, done))

    async def restore(self, session: str) -> SessionInfo:
        return await self._on_loop(lambda done: self.book.restore(session, done))

    async def session(self, session: str) -> SessionInfo:
        return await self._on_loop(lambda done: done(self.book.info(session)))

    async def delete(self, session: str) -> tuple[SessionInfo, int]:
        return await self._on_loop(lambda done: self.book.delete(session, done))

    async def sessions(self, limit: int) -> tuple[list[SessionInfo], int]:
        return await self._on_loop(lambda done: done(self.book.list_sessions(limit)))

    async def memory(self, probe_timeout_ms: int) -> bytes:
        fut = self.proc.submit(AskMemory(ask_id=f"api-memory-{time.monotonic_ns()}", probe_timeout_ms=probe_timeout_ms))
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(fut), probe_timeout_ms / 1000 + 10)
        except asyncio.TimeoutError:
            raise BackendError(503, "the control process did not answer the memory ask in time", type="server_error",
                               code="memory_timeout") from None
        if not isinstance(answer, MemoryAnswer):
            raise BackendError(503, f"the memory ask was not answered: {getattr(answer, 'detail', answer)!r}",
                               type="server_error", code="memory_unavailable")
        return answer.view

    async def ask_control(self, ask):
        """Hand an operator's ask (e.g. ``AskResize``) to the control process; its ``AskAnswered``
        once what it recorded is committed."""
        return await asyncio.wait_for(asyncio.wrap_future(self.proc.submit(ask, "operator")), self.api_timeout_s)

    def stats(self) -> BackendStats:
        try:
            snapshot = self.proc.call(lambda _proc: self.serving_stats.collect(self.draining))
            self._last_stats = snapshot.result(timeout=2.0)
        except Exception as e:  # noqa: BLE001 - a stuck loop must not hang /metrics; health says why
            log.warning("stats_unavailable", error=repr(e))
        return self._last_stats

    def health(self) -> Health:
        h = self.proc.health()
        detail: dict[str, object] = {"models": [m.id for m in self.models()], "problems": list(h.problems)}
        if not self.workers.ready:
            detail["problems"].append("no worker serves a model yet")
        detail["problems"].extend(self.flips.problems)      # a stranded arena serves nothing until repaired
        if self.draining:
            detail["problems"].append(f"shutting down: {self.num_pending()} accepted requests finishing")
        wedged = self._wedged
        for e in wedged.values():
            detail["problems"].append(f"worker {e.worker} is wedged: no step for {e.stalled_ms} ms with {e.running} "
                                      f"request(s) running (deadline {e.deadline_ms} ms, last step {e.last_step})")
        if wedged:
            detail["wedged_workers"] = sorted(wedged)
        closed = dict(self.workers.closed)
        detail["problems"] += [message for _, message in closed.values()]
        return Health(ok=h.healthy and bool(self.workers.ready) and not self.draining and not wedged and not closed
                      and not self.flips.problems, detail=detail)

    def _post_cancel(self, request_id: str, reason: str) -> None:
        self.proc.call(lambda _proc: self.streams.cancel(request_id, reason))

    async def _on_loop(self, start):
        """Run ``start(done)`` on the loop thread; ``done(value_or_exception)`` resolves the await."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(value) -> None:
            def settle():
                if fut.done():
                    return
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
            loop.call_soon_threadsafe(settle)

        def run(_proc):
            try:
                start(done)
            except BackendError as e:
                done(e)
        self.proc.call(run)
        return await asyncio.wait_for(fut, self.api_timeout_s)

    # ================================================================== loop thread
    def on_ready(self, link, msg: ServingReady) -> None:
        self.workers.on_ready(link, msg)
        if link.worker in self.workers.ready:
            self.flips.on_ready(link.worker, msg)
            self.flips.release()

    def on_step(self, link, msg: ev.StepCompleted) -> None:
        self.proc.record(msg)
        # the prefill's own speed: what the step waited for restored pages still landing is not prefill
        self.cost.observe_prefill(msg.num_tokens - msg.num_seqs, (msg.duration_ns - (msg.restore_wait_ns or 0)) / 1e9)
        self.workers.wedge.observe_step(link.worker, msg.step, msg.duration_ns, time.monotonic_ns())

    def _on_experts(self, link, msg: ev.ExpertsMoved) -> None:
        """An offloaded MoE worker's expert moves of one step: into the ledger, and its measured
        copies teach the cost model the host -> device bandwidth (the link KV restores cross too)."""
        self.proc.record(msg)
        self.cost.observe_expert_moves(msg.moves)

    def _on_pong(self, link, msg: Pong) -> None:
        # NOTE: this handler replaces the worker registry's own for Pong: it is called first
        self.proc.workers.on_pong(link, msg)
        self.workers.wedge.observe_pong(link.worker, msg.num_steps, msg.num_running, msg.num_turns,
                                        time.monotonic_ns())

    def _on_recorded(self, seq: int, event: ev.Event) -> None:
        self.serving_stats.observe(event)
        t = type(event)
        if t in TERMINAL:
            self.admission.on_outcome(event)
        if (t in TERMINAL or t is ev.BlocksFreed or t is ev.CopiesReleased or t is ev.RebindCommitted
                or t is ev.RebindRefused):   # room may have appeared for a waiting request, or its pool reopened
            self.admission.retry_soon()
        elif t is ev.WorkerJoined:
            self.workers.wedge.forget(event.worker)       # a new incarnation counts its steps from 0
        elif t is ev.WorkerLost:
            self.workers.wedge.forget(event.worker)
            self.workers.lost(event.worker)
            self.streams.worker_lost(event.worker)
            self.workers.lost_pages(event.worker, set(event.kept_on_disk))     # a disk copy that survived stays

    def _pool_view(self, state, worker: int, to_gen: int, to_bytes: int) -> int:
        """The scheduler as a reader of ``worker``'s device pool: its capacity is read from the
        folded state and its block tables hold logical page ids (the worker maps them to slots), so
        it is at ``to_gen`` once the state carries the new size; -1 (behind) otherwise."""
        ws = state.workers.get(worker)
        return to_gen if ws is not None and ws.tiers["device"].capacity_bytes == to_bytes else -1

    def _on_worker_gone(self, worker: int) -> None:
        """Its process exited and its loss waits for the next incarnation to say which disk files
        survived: nothing more is routed there, and what ran there is answered now, as a loss
        would (the WorkerLost that follows finds these requests already ended)."""
        self.workers.wedge.forget(worker)
        self.workers.lost(worker)
        self.streams.worker_lost(worker)

    def _tick_loop(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            if not self.proc.running:
                continue
            self.proc.call(lambda _proc: self._tick())

    def _tick(self) -> None:
        now = time.time_ns()
        sched = self.workers.sched
        if sched is not None and now - self._last_prune_ns > PRUNE_EVERY_NS:
            self._last_prune_ns = now
            sched.prune(self.proc.state, now, PRUNE_IDLE_NS)
        self.admission.expire_waits(now)
        self.flips.watch()
        if self.requests.waiting:
            self.admission.retry_waiting()
        self._watch_wedges(time.monotonic_ns())

    def _watch_wedges(self, now_ns: int) -> None:
        running: dict[int, list[str]] = {}
        for r in self.requests.by_id.values():
            if r.phase == "running":
                running.setdefault(r.worker, []).append(r.request_id)
        wedge = self.workers.wedge
        for e in wedge.check(running, now_ns):
            self.proc.record(e)
            if type(e) is ev.WorkerWedged:
                log.error("worker_wedged", worker=e.worker, running=e.running, last_step=e.last_step,
                          stalled_ms=e.stalled_ms, deadline_ms=e.deadline_ms)
                self.streams.worker_wedged(e.worker, f"no step for {e.stalled_ms} ms (deadline {e.deadline_ms} ms)")
            else:
                log.warning("worker_resumed", worker=e.worker, step=e.step, wedged_ms=e.wedged_ms)
                self.admission.retry_soon()
        self._wedged = wedge.wedged()
