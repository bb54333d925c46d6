"""``ServingService``: the control process's side of inference; implements the API's ``Backend``.

Everything that decides or records runs on the control loop thread (handlers of worker messages,
``proc.call``), where the folded state is consistent; the API's coroutines only post work there
and await the answer (``bridge``). The pure decisions are ``Scheduler``'s.

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
import collections
import itertools
import threading
import time

import msgspec
import structlog

from residency.control.api.backend import (
    BackendError, BackendStats, Chunk, GenerateRequest, Health, ModelCard, SessionInfo, Usage,
)
from residency.control.scheduler.bridge import Pending, Stream
from residency.control.scheduler.config import SchedulerConfig
from residency.control.scheduler.core import Admit, GenerateAsk, Refuse, Scheduler, Wait
from residency.control.scheduler.cost import CostModel
from residency.control.scheduler.service_routing import RoutingOps
from residency.control.scheduler.service_sessions import SessionOps
from residency.control.scheduler.retain import is_retained, retained_session_for
from residency.control.scheduler.service_stats import collect_stats
from residency.control.policy.proposals import busy_blocks
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, Generate, ServingReady, Tokenize, Tokenized, TokensGenerated
from residency.events.asks import AskAnswered, AskMove

log = structlog.get_logger("control.serving")
TERMINAL = (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected, ev.MoveStranded, ev.MoveAbandoned, ev.MoveLateAcked)
FREE_REASON = {"stop": "finished", "length": "finished", "error": "error"}


class ServingService(SessionOps, RoutingOps):
    def __init__(self, proc, *, restore_policy: str = "cost", share_prefixes: bool = True, retain_fraction: float = 0.0,
                 cost: CostModel | None = None, wait_timeout_s: float = 120.0, max_waiting: int = 256,
                 tick_s: float = 0.25, api_timeout_s: float = 600.0, default_max_tokens: int | None = None):
        self.proc = proc
        self.restore_policy = restore_policy
        self.share_prefixes = share_prefixes
        self.retain_fraction = retain_fraction       # of the host tier: prefixes kept for requests outside a session
        self._evicting: set[str] = set()
        self.cost = cost or CostModel()
        self.wait_timeout_ns = int(wait_timeout_s * 1e9)
        self.max_waiting = max_waiting
        self.api_timeout_s = api_timeout_s
        self.default_max_tokens = default_max_tokens     # a chat that names no max_tokens; None: the context's rest
        self.ready: dict[int, ServingReady] = {}
        self.sched: Scheduler | None = None
        self.pending: dict[str, Pending] = {}
        self.draining = False             # set by drain(): new requests are refused
        self.disk_bytes_kept = 0          # WorkerLost.bytes_kept recorded by this process (/metrics)
        self.waiting: list[Pending] = []
        self.moves: collections.Counter = collections.Counter()     # (kind, outcome)
        self.routed: collections.Counter = collections.Counter()    # reason a request runs where it does
        self._kind_of: dict[str, str] = {}
        self._src_of: dict[str, str] = {}                          # restore move -> source tier
        self._park_backoff: dict[str, int] = {}                    # session -> no park asked before (ns)
        self.park_backoff_s = 2.0
        self._last_prune_ns = 0
        self._retry_posted = False
        self._ask_ids = itertools.count(1)
        self._stats = BackendStats()
        self._stop = threading.Event()
        for msg_type, handler in ((ServingReady, self._on_ready), (Tokenized, self._on_tokenized),
                                  (TokensGenerated, self._on_tokens), (ev.StepCompleted, self._on_step)):
            proc.on_worker_message(msg_type, handler)
        proc.add_listener(self._on_recorded)
        proc.blocks_in_use = self._blocks_in_use
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,), name="serving-tick", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stop.set()

    # ================================================================== Backend (API thread)
    def models(self) -> list[ModelCard]:
        seen: dict[str, ModelCard] = {}
        for r in list(self.ready.values()):
            seen.setdefault(r.model, ModelCard(id=r.model, max_context=r.max_context, created=0))
        return list(seen.values())

    def drain(self) -> None:
        """The server is stopping: refuse new requests (503), let those accepted finish."""
        self.draining = True

    def num_pending(self) -> int:
        """Requests accepted and not finished (tokenizing, waiting, restoring or running)."""
        return len(self.pending)

    async def submit(self, req: GenerateRequest) -> Stream:
        if self.draining:
            raise BackendError(503, "the server is shutting down; send the request to another instance",
                               type="server_error", code="server_shutting_down")
        p = Pending(req, asyncio.get_running_loop())
        self.proc.call(lambda _proc: self._begin(p))
        try:
            await asyncio.wait_for(asyncio.shield(p.admitted), self.api_timeout_s)
        except asyncio.TimeoutError:
            self._post_cancel(req.request_id, "timeout")
            raise BackendError(503, "the control process did not admit the request in time", type="server_error",
                               code="admission_timeout") from None
        except asyncio.CancelledError:
            self._post_cancel(req.request_id, "disconnected")
            raise
        return Stream(p, self._post_cancel)

    async def park(self, session: str, tier: str = "host") -> SessionInfo:
        return await self._on_loop(lambda done: self._park(session, tier, done))

    async def restore(self, session: str) -> SessionInfo:
        return await self._on_loop(lambda done: self._restore(session, done))

    async def session(self, session: str) -> SessionInfo:
        return await self._on_loop(lambda done: done(self._info_or_404(session)))

    async def delete(self, session: str) -> tuple[SessionInfo, int]:
        return await self._on_loop(lambda done: self._delete(session, done))

    async def sessions(self, limit: int) -> tuple[list[SessionInfo], int]:
        return await self._on_loop(lambda done: done(self._list_sessions(limit)))

    def stats(self) -> BackendStats:
        try:
            self._stats = self.proc.call(lambda _proc: self._collect_stats()).result(timeout=2.0)
        except Exception as e:  # noqa: BLE001 - a stuck loop must not hang /metrics; health says why
            log.warning("stats_unavailable", error=repr(e))
        return self._stats

    def health(self) -> Health:
        h = self.proc.health()
        detail: dict[str, object] = {"models": [m.id for m in self.models()], "problems": list(h.problems)}
        if not self.ready:
            detail["problems"].append("no worker serves a model yet")
        if self.draining:
            detail["problems"].append(f"shutting down: {len(self.pending)} accepted requests finishing")
        return Health(ok=h.healthy and bool(self.ready) and not self.draining, detail=detail)

    def _post_cancel(self, request_id: str, reason: str) -> None:
        self.proc.call(lambda _proc: self._cancel(request_id, reason))

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

    def _tick_loop(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            if not self.proc.running:
                continue
            self.proc.call(lambda _proc: self._tick())

    # ================================================================== loop thread: requests
    def _begin(self, p: Pending) -> None:
        if p.cancelled:
            return
        worker = self._choose_worker(p.req.session)
        if self.sched is None or worker is None:
            p.reject(BackendError(503, "no worker is serving a model yet; retry shortly", type="server_error",
                                  code="model_loading"))
            return
        p.worker, p.phase = worker, "tokenizing"
        self.pending[p.request_id] = p
        req = p.req
        msg = Tokenize(request_id=p.request_id, messages=req.messages, prompt=req.prompt,
                       prompt_token_ids=req.prompt_token_ids)
        if not self.proc.send_to_worker(worker, msg):
            self._forget(p)
            p.reject(BackendError(503, f"worker {worker} is unreachable", type="server_error",
                                  code="worker_unavailable"))

    def _on_tokenized(self, link, msg: Tokenized) -> None:
        p = self.pending.get(msg.request_id)
        if p is None or p.phase != "tokenizing":
            return
        if p.cancelled:
            self._forget(p)
            return
        req = p.req
        param = "messages" if req.kind == "chat" else "prompt"
        if msg.error is not None:
            code, _, detail = msg.error.partition(": ")
            self._refuse(p, 400, code, detail or msg.error, param)
            return
        n, ctx = len(msg.token_ids), self.ready[p.worker].max_context
        if n >= ctx:
            self._refuse(p, 400, "context_length_exceeded",
                         f"this model's context window is {ctx} tokens; the prompt is {n} tokens", param)
            return
        if req.max_tokens_given:
            max_tokens = req.sampling.max_tokens
        else:
            max_tokens = min(ctx - n, self.default_max_tokens or ctx)
        if n + max_tokens > ctx:
            self._refuse(p, 400, "context_length_exceeded",
                         f"this model's context window is {ctx} tokens; the prompt ({n}) plus max_tokens "
                         f"({max_tokens}) is {n + max_tokens}", "max_tokens")
            return
        p.token_ids, p.keys, p.max_tokens = list(msg.token_ids), list(msg.keys), max_tokens
        self._route(p)
        self._admit(p)

    def _admit(self, p: Pending) -> None:
        now = time.time_ns()
        if p.req.session is None and self.retain_fraction > 0:
            p.session = retained_session_for(
                self.sched.sessions.values(), self.proc.state, p.worker, request_id=p.request_id,
                prompt_keys=p.keys, prompt_tokens=len(p.token_ids), page_tokens=self.sched.cfg.page_tokens,
                moving=busy_blocks(self.proc.state).get(p.worker, set()))
        ask = GenerateAsk(request_id=p.request_id, session=p.session, worker=p.worker,
                          prompt_tokens=len(p.token_ids), prompt_keys=p.keys, max_tokens=p.max_tokens)
        plan = self.sched.plan(self.proc.state, ask)
        if isinstance(plan, Refuse):
            self._refuse(p, plan.status, plan.code, plan.reason, "session_id" if plan.code == "session_busy" else None)
            return
        if isinstance(plan, Wait):
            if p.phase != "waiting":
                if len(self.waiting) >= self.max_waiting:
                    self._refuse(p, 503, "server_overloaded", f"{len(self.waiting)} requests are already waiting")
                    return
                p.phase, p.wait_since_ns = "waiting", now
                self.waiting.append(p)
                log.info("request_waiting", request_id=p.request_id, reason=plan.reason, park=plan.park)
            p.wait_code, p.wait_reason = plan.code, plan.reason
            for s in plan.park:
                if s not in p.parks_asked and self._park_backoff.get(s, 0) <= now:
                    p.parks_asked.add(s)
                    self._ask(AskMove(ask_id=self._ask_id("park"), kind="park", worker=p.worker, session=s),
                              "serving", lambda ans, p=p, s=s: self._parked_for(p, s, ans))
            return
        if p in self.waiting:
            self.waiting.remove(p)
        self._record(ev.RequestAdmitted(request_id=p.request_id, session=p.session,
                                        prompt_tokens=len(p.token_ids), worker=p.worker, routed_from=p.routed_from,
                                        shared_tokens=len(plan.shared) * self.sched.cfg.page_tokens,
                                        shared_from=plan.shared_from, shared_blocks=list(plan.shared),
                                        copied=plan.copied), p.request_id)
        self.sched.start(plan, now)
        p.admit = plan
        if plan.decision is not None:
            log.info("prefix_decision", request_id=p.request_id, session=p.session, choice=plan.decision.choice,
                     reason=plan.decision.reason)
        self._release(p.worker, plan.drop, "superseded", p.session)
        if plan.restore:
            p.phase = "restoring"
            blocks = [b for bl in plan.restore.values() for b in bl]
            owner = plan.shared_from if plan.shared else p.session     # a shared prefix stays its donor's
            self._ask(AskMove(ask_id=self._ask_id("restore"), kind="restore", worker=p.worker, blocks=blocks,
                              session=owner), "serving", lambda ans: self._restored(p, ans))
        else:
            self._run(p)

    def _parked_for(self, p: Pending, session: str, ans: AskAnswered) -> None:
        """A park asked to make room answered. Refused (the host is full) or invalid: ask again
        only after a backoff, never in a loop of refusals."""
        if ans.error is not None or any(type(e) is not ev.MoveAcked for e in ans.events if type(e) in TERMINAL
                                        or type(e) is ev.MoveRefused):
            log.info("park_for_room_failed", request_id=p.request_id, session=session, error=ans.error,
                     detail=ans.detail, events=[type(e).__name__ for e in ans.events])
            p.parks_asked.discard(session)
            self._park_backoff[session] = time.time_ns() + int(self.park_backoff_s * 1e9)

    def _restored(self, p: Pending, ans: AskAnswered) -> None:
        acked = [e for e in ans.events if type(e) is ev.MoveAcked]
        ok = ans.error is None and len(acked) == len(ans.move_ids) > 0 and all(e.checksum_ok for e in acked)
        if p.cancelled:
            self._end_unstarted(p)
            return
        if not ok:
            why = ans.error or ", ".join(type(e).__name__ for e in ans.events) or "no answer"
            log.warning("restore_failed_recomputing", request_id=p.request_id, session=p.session, why=why,
                        detail=ans.detail)
            admit = self.sched.recompute_instead(self.proc.state, p.request_id)
            self._release(p.worker, admit.drop, "restore_failed", p.session)
            p.admit = admit
        self._run(p)

    def _run(self, p: Pending) -> None:
        a: Admit = p.admit
        if p.cancelled:
            self._end_unstarted(p)
            return
        p.phase = "running"
        sampling = msgspec.structs.replace(p.req.sampling, max_tokens=p.max_tokens)
        cmd = Generate(request_id=p.request_id, session=p.session, token_ids=p.token_ids, block_ids=a.blocks,
                       num_cached_tokens=a.num_cached_tokens, sampling=sampling,
                       free_on_finish=p.session is None, copy_from=list(a.shared) if a.copied else [])
        if not self.proc.send_to_worker(p.worker, cmd):
            self._end_unstarted(p, reason="error")
            p.reject(BackendError(503, f"worker {p.worker} is unreachable", type="server_error",
                                  code="worker_unavailable"))
            return
        p.accept()

    def _on_tokens(self, link, msg: TokensGenerated) -> None:
        p = self.pending.get(msg.request_id)
        session = p.session if p is not None else None
        bb = self.proc.state.workers[link.worker].block_bytes
        if msg.blocks_written:
            self._record(ev.BlocksCommitted(worker=link.worker, session=session, tier="device",
                                            blocks=list(msg.blocks_written), keys=list(msg.keys_written),
                                            bytes=len(msg.blocks_written) * bb), msg.request_id)
            self.sched.written(msg.request_id, msg.blocks_written, msg.keys_written)
        if p is None:
            if msg.blocks_freed:
                self._record(ev.BlocksFreed(worker=link.worker, tier="device", blocks=list(msg.blocks_freed),
                                            bytes=msg.bytes_freed, reason="orphaned"), msg.request_id)
            return
        p.num_generated += len(msg.token_ids)
        if msg.finish_reason is None:
            if msg.token_ids or msg.text:
                p.push(Chunk(text=msg.text, token_ids=list(msg.token_ids), logprobs=list(msg.logprobs)))
            return
        reason = msg.finish_reason
        why = (p.cancelled or "cancelled") if reason == "cancelled" else FREE_REASON.get(reason, reason)
        if msg.blocks_freed:
            self._record(ev.BlocksFreed(worker=link.worker, tier="device", blocks=list(msg.blocks_freed),
                                        bytes=msg.bytes_freed, reason=why), msg.request_id)
        self._record(ev.RequestFinished(request_id=p.request_id, reason=reason if reason != "cancelled" else why,
                                        completion_tokens=p.num_generated), p.request_id)
        a: Admit = p.admit
        self.sched.finish(p.request_id, reason, len(p.token_ids) + max(0, p.num_generated - 1), time.time_ns())
        self._forget(p)
        usage = Usage(prompt_tokens=len(p.token_ids), completion_tokens=p.num_generated,
                      cached_tokens=a.num_cached_tokens, restored_tokens=a.restored_tokens,
                      computed_tokens=msg.num_computed_tokens,
                      shared_tokens=len(a.shared) * self.sched.cfg.page_tokens)
        p.push(Chunk(text=msg.text, token_ids=list(msg.token_ids), finish_reason=reason, usage=usage,
                     error=msg.error, logprobs=list(msg.logprobs)))
        if is_retained(p.session):
            self._evict_retained()
        self._post_retry()

    def _cancel(self, request_id: str, reason: str) -> None:
        p = self.pending.get(request_id)
        if p is None or p.cancelled:
            return
        p.cancelled = reason
        if p.phase == "running":
            self.proc.send_to_worker(p.worker, CancelGenerate(request_id=request_id, reason=reason))
        elif p.phase in ("new", "tokenizing", "waiting"):
            self._forget(p)              # never admitted: nothing to record
            p.reject(BackendError(499, "the client went away", code="client_disconnected"))
        # restoring: _restored sees it and ends the request

    def _end_unstarted(self, p: Pending, reason: str | None = None) -> None:
        """An admitted request that never reached the worker: finish it by the book."""
        why = reason or p.cancelled or "cancelled"
        self._record(ev.RequestFinished(request_id=p.request_id, reason=why, completion_tokens=0), p.request_id)
        self.sched.finish(p.request_id, "cancelled", 0, time.time_ns())
        self._forget(p)
        p.reject(BackendError(499, "the client went away", code="client_disconnected"))
        self._post_retry()

    def _refuse(self, p: Pending, status: int, code: str, message: str, param: str | None = None) -> None:
        self._record(ev.RequestRefused(request_id=p.request_id, reason=f"{code}: {message}"), p.request_id)
        self._forget(p)
        p.reject(BackendError(status, message, type="server_error" if status >= 500 else "invalid_request_error",
                              code=code, param=param))

    def _forget(self, p: Pending) -> None:
        p.phase = "done"
        self.pending.pop(p.request_id, None)
        if p in self.waiting:
            self.waiting.remove(p)

    def _record(self, event: ev.Event, correlation: str | None = None) -> int:
        return self.proc.record(event, correlation=correlation)

    def _on_ready(self, link, msg: ServingReady) -> None:
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
        self.sched.set_max_seqs(link.worker, msg.max_seqs)
        log.info("serving_ready", worker=link.worker, model=msg.model, max_context=msg.max_context,
                 device_blocks=msg.device_blocks, max_seqs=msg.max_seqs)

    def _on_step(self, link, msg: ev.StepCompleted) -> None:
        self._record(msg)
        self.cost.observe_prefill(msg.num_tokens - msg.num_seqs, msg.duration_ns / 1e9)

    def _on_recorded(self, seq: int, event: ev.Event) -> None:
        t = type(event)
        if t is ev.MoveRequested:
            self._kind_of[event.move_id] = event.kind
            if event.kind == "restore":
                self._src_of[event.move_id] = event.src
        elif t in TERMINAL:
            kind = self._kind_of.get(event.move_id, "unknown")
            self.moves[(kind, t.__name__)] += 1
            if t is not ev.MoveStranded:
                self._kind_of.pop(event.move_id, None)
                src = self._src_of.pop(event.move_id, None)
                if src is not None and t is ev.MoveAcked:       # a restore the worker timed: its bandwidth
                    self.cost.observe_transfer(src, event.bytes_moved, (event.finished_ns - event.started_ns) / 1e9)
            self._post_retry()
        elif t is ev.BlocksFreed:
            self._post_retry()
        elif t is ev.WorkerLost:
            self.disk_bytes_kept += event.bytes_kept
            self._worker_lost(event.worker, set(event.kept_on_disk))

    def _worker_lost(self, worker: int, kept: set[int] = frozenset()) -> None:
        self.ready.pop(worker, None)
        for p in [p for p in self.pending.values() if p.worker == worker]:
            if p.phase == "running":
                p.push(Chunk(text="", finish_reason="error", error=f"worker {worker} was lost",
                             usage=Usage(prompt_tokens=len(p.token_ids), completion_tokens=p.num_generated)))
                self._record(ev.RequestFinished(request_id=p.request_id, reason="error",
                                                completion_tokens=p.num_generated), p.request_id)
                self.sched.finish(p.request_id, "error", 0, time.time_ns())
                self._forget(p)
            elif p.phase in ("tokenizing", "waiting"):
                self._forget(p)
                p.reject(BackendError(503, f"worker {worker} was lost", type="server_error", code="worker_lost"))
        if self.sched is not None:      # a session keeps the pages whose disk copy survived
            lost = {b for e in self.sched.sessions.values() if e.worker == worker for b in e.blocks} - kept
            self.sched.forget_blocks(worker, lost)

    def _post_retry(self) -> None:
        if self.waiting and not self._retry_posted:
            self._retry_posted = True
            self.proc.call(lambda _proc: self._retry_waiting())

    def _retry_waiting(self) -> None:
        self._retry_posted = False
        for p in list(self.waiting):
            if p.phase == "waiting" and not p.cancelled:
                self._admit(p)

    def _tick(self) -> None:
        now = time.time_ns()
        if self.sched is not None and now - self._last_prune_ns > 60 * 10**9:
            self._last_prune_ns = now
            self.sched.prune(self.proc.state, now, 600 * 10**9)
        for p in list(self.waiting):
            if now - p.wait_since_ns > self.wait_timeout_ns:
                self._refuse(p, 503, p.wait_code, f"waited {self.wait_timeout_ns // 10**9} s: {p.wait_reason}")
        if self.waiting:
            self._retry_waiting()

    def _blocks_in_use(self) -> dict[int, set[int]]:
        return self.sched.busy_blocks() if self.sched is not None else {}

    def _collect_stats(self) -> BackendStats:
        return collect_stats(self)
