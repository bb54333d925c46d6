"""From an accepted request to a ``Generate`` sent to its worker: tokenize, route, plan, wait for
room, restore the prefix, run. Loop thread only.

    begin ─► Tokenize ─► on_tokenized ─► route ─► admit ─► plan: Refuse ─► RequestRefused
                                                              Wait   ─► waiting (parks asked for room),
                                                                        admitted again when room appears
                                                              Admit  ─► RequestAdmitted, release superseded
                                                                        pages, restore the prefix ─► run

A request held for a model no worker serves now (the Flipper's gate) is tokenized while it waits
(control/flip_waiting.py) and checked by the same ``check_tokens``; when it starts over it keeps
its Tokenized and is not tokenized again.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import structlog

from residency.control.policy.proposals import busy_blocks
from residency.control.scheduler.asker import TERMINAL, Asker
from residency.control.scheduler.bridge import RequestState
from residency.control.scheduler.core import Admit, PendingRequest, Refuse, Wait
from residency.control.scheduler.port import BackendError
from residency.control.scheduler.requests import RequestTable
from residency.control.scheduler.retain import retained_session_for
from residency.control.scheduler.router import Router
from residency.control.scheduler.workers import ServingWorkers
from residency.events import catalog as ev
from residency.events.asks import AskAnswered, AskMove
from residency.events.commands import Generate, Tokenize, Tokenized

log = structlog.get_logger("control.serving")
# a request its worker cannot serve now (wedged, lost) is answered 503 with this Retry-After: by
# then it may go to another worker, or to this one back on its feet
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class TokensRefused:
    """Why a tokenized prompt cannot run on a model: the 400 its client is answered with."""
    code: str
    message: str
    param: str | None
    status: int = 400


def check_tokens(req, msg: Tokenized, ready, default_max_tokens: int | None) -> TokensRefused | int:
    """The checks of a ``Tokenized`` answer against the model it names on a worker (``ready``: that
    worker's ServingReady): the worker's own refusal, logit_bias ids outside the vocabulary, a prompt
    or prompt plus max_tokens past the model's context. Returns the max_tokens the request runs with
    (the rest of the context, capped by ``default_max_tokens``, when the client named none), or why
    not. Pure: run when a request is tokenized and again when a request tokenized while it was held
    for its model starts over on the worker that serves it."""
    param = "messages" if req.kind == "chat" else "prompt"
    if msg.error is not None:
        code, _, detail = msg.error.partition(": ")
        return TokensRefused(code, detail or msg.error, param)
    outside = sorted(t for t in req.sampling.logit_bias if msg.vocab_size is not None and t >= msg.vocab_size)
    if outside:
        return TokensRefused("invalid_token_id", f"logit_bias names token id {outside[0]}, outside this model's "
                                                 f"vocabulary of {msg.vocab_size} tokens", "logit_bias")
    n, ctx = len(msg.token_ids), next((m.max_context for m in ready.models if m.name == req.model), ready.max_context)
    if n >= ctx:
        return TokensRefused("context_length_exceeded",
                             f"this model's context window is {ctx} tokens; the prompt is {n} tokens", param)
    max_tokens = req.sampling.max_tokens if req.max_tokens_given else min(ctx - n, default_max_tokens or ctx)
    if n + max_tokens > ctx:
        return TokensRefused("context_length_exceeded", f"this model's context window is {ctx} tokens; the prompt "
                                                        f"({n}) plus max_tokens ({max_tokens}) is {n + max_tokens}",
                             "max_tokens")
    return max_tokens


class Admission:
    def __init__(self, proc, workers: ServingWorkers, requests: RequestTable, router: Router, asker: Asker, *,
                 retain_fraction: float, max_waiting: int, wait_timeout_s: float, default_max_tokens: int | None,
                 park_backoff_s: float = 2.0):
        self.proc = proc
        self.workers = workers
        self.requests = requests
        self.router = router
        self.asker = asker
        self.retain_fraction = retain_fraction
        self.max_waiting = max_waiting
        self.wait_timeout_ns = int(wait_timeout_s * 1e9)
        self.default_max_tokens = default_max_tokens     # a chat that names no max_tokens; None: the context's rest
        self.park_backoff_s = park_backoff_s
        self._park_backoff: dict[str, int] = {}         # session -> no park asked before (ns)
        self._retry_posted = False
        # the Flipper's (control/flipping.py): hold a request whose model no worker serves now
        # (True: held, it comes back here once one does), and why a worker takes no request now
        self.gate: Callable[[RequestState], bool] = lambda r: False
        self.flip_holds: Callable[[RequestState], tuple[str, str] | None] = lambda r: None
        # the answer to a Tokenize sent for a request while it is held (HeldRequests.on_tokenized)
        self.held_tokenized: Callable[[RequestState, int, Tokenized], None] = lambda r, worker, msg: None
        # restores whose turn ran: "pipelined" (its Generate sent once the restore was dispatched,
        # the prefill reading layers as they land) or "plain" (sent after the restore's ack)
        self.restores: collections.Counter = collections.Counter()
        # pipelined restores whose turn runs while they land: move_id -> (worker, the pages' session,
        # the pages, whether they are another session's shared with the turn)
        self._landing: dict[str, tuple[int, str | None, list[int], bool]] = {}

    def begin(self, r: RequestState) -> None:
        if r.cancelled:
            return
        if self.gate(r):
            return
        worker = self.router.choose_worker(r.req.session, r.req.model)
        closed = self.workers.refusal() if worker is None else None
        if closed is not None:          # e.g. a group stopped: said, never served by one rank's view
            r.reject(BackendError(503, closed[1], type="server_error", code=closed[0]))
            return
        if self.workers.sched is None or worker is None:
            r.reject(BackendError(503, "no worker is serving a model yet; retry shortly", type="server_error",
                                  code="model_loading"))
            return
        r.worker, r.phase = worker, "tokenizing"
        self.requests.add(r)
        if r.tokenized is not None:     # tokenized while held for its model: checked here, not tokenized again
            self._tokens(r, r.tokenized)
            return
        req = r.req
        msg = Tokenize(request_id=r.request_id, messages=req.messages, prompt=req.prompt,
                       prompt_token_ids=req.prompt_token_ids, model=self._model_arg(worker, req.model))
        failed = self._send(worker, msg)
        if failed is not None:
            self.requests.forget(r)
            r.reject(failed)

    def on_tokenized(self, link, msg: Tokenized) -> None:
        r = self.requests.get(msg.request_id)
        if r is None:
            return
        if r.phase == "held":           # tokenized while it waits for its model
            self.held_tokenized(r, link.worker, msg)
            return
        if r.phase != "tokenizing":
            return
        if r.cancelled:
            self.requests.forget(r)
            return
        self._tokens(r, msg)

    def check(self, r: RequestState, msg: Tokenized, worker: int) -> TokensRefused | int:
        """``check_tokens`` against ``worker``'s card of the request's model."""
        return check_tokens(r.req, msg, self.workers.ready[worker], self.default_max_tokens)

    def _tokens(self, r: RequestState, msg: Tokenized) -> None:
        """Run the checks on ``r``'s worker; refused (400), or routed and admitted with its tokens."""
        verdict = self.check(r, msg, r.worker)
        if isinstance(verdict, TokensRefused):
            self.refuse(r, verdict.status, verdict.code, verdict.message, verdict.param)
            return
        r.tokenized = msg
        r.token_ids, r.keys, r.max_tokens = list(msg.token_ids), list(msg.keys), verdict
        self.router.route(r)
        self.admit(r)

    def admit(self, r: RequestState) -> None:
        now = time.time_ns()
        sched = self.workers.sched
        if r.worker in self.workers.closed:
            code, message = self.workers.closed[r.worker]
            self.refuse(r, 503, code, message)
            return
        if self.workers.wedge.is_wedged(r.worker):
            self.refuse(r, 503, "worker_wedged", f"worker {r.worker} makes no progress; retry shortly",
                        retry_after_s=RETRY_AFTER_S)
            return
        if r.req.session is None and self.retain_fraction > 0:
            r.session = retained_session_for(
                sched.sessions.values(), self.proc.state, r.worker, request_id=r.request_id,
                prompt_keys=r.keys, prompt_tokens=len(r.token_ids), page_tokens=sched.cfg.page_tokens,
                moving=busy_blocks(self.proc.state).get(r.worker, set()))
        pending = PendingRequest(request_id=r.request_id, session=r.session, worker=r.worker,
                                 prompt_tokens=len(r.token_ids), prompt_keys=r.keys, max_tokens=r.max_tokens)
        held = self.proc.dial.holds(r.worker) if getattr(self.proc, "dial", None) is not None else None
        held = held or self.flip_holds(r)
        if held is not None and held[0] == "model_not_resident":     # tokenized for a model flipped out since
            self.requests.forget(r)
            r.phase = "new"
            self.begin(r)
            return
        if held is not None:            # a resize is moving blocks out of the pool, or it is closed
            plan = Wait(request_id=r.request_id, code=held[0], reason=held[1])
        else:
            plan = sched.plan(self.proc.state, pending)
        if isinstance(plan, Refuse):
            self.refuse(r, plan.status, plan.code, plan.reason, "session_id" if plan.code == "session_busy" else None)
            return
        if isinstance(plan, Wait):
            self._wait(r, plan, now)
            return
        self.requests.admitted(r)
        self.proc.record(ev.RequestAdmitted(request_id=r.request_id, session=r.session,
                                            prompt_tokens=len(r.token_ids), worker=r.worker,
                                            routed_from=r.routed_from,
                                            shared_tokens=len(plan.shared) * sched.cfg.page_tokens,
                                            shared_from=plan.shared_from, shared_blocks=list(plan.shared),
                                            copied=plan.copied), correlation=r.request_id)
        sched.start(plan, now)
        r.admit = plan
        if plan.decision is not None:
            log.info("prefix_decision", request_id=r.request_id, session=r.session, choice=plan.decision.choice,
                     reason=plan.decision.reason)
        self.asker.release(r.worker, plan.drop, "superseded", r.session)
        if plan.restore:
            r.phase = "restoring"
            blocks = [b for bl in plan.restore.values() for b in bl]
            owner = plan.shared_from if plan.shared else r.session     # a shared prefix stays its donor's
            pipelined = self._can_pipeline(r, plan)
            # pipelined: answered once the MoveRequested is committed (its ExecuteMove then leaves
            # first, write-ahead as always); the Generate follows it on the same ordered link
            self.asker.ask(AskMove(ask_id=self.asker.new_id("restore"), kind="restore", worker=r.worker,
                                   blocks=blocks, session=owner, wait=not pipelined), "serving",
                           (lambda ans: self._dispatched(r, ans)) if pipelined else (lambda ans: self._restored(r, ans)))
        else:
            self._run(r)

    def _can_pipeline(self, r: RequestState, plan: Admit) -> bool:
        """The worker starts a prefill while its restore lands (``ServingReady.restore_overlap``),
        and the restore is one move: every page from one tier, the host or disk (pages from both
        are two moves, and a Generate awaits one). The pages are the turn's own, or a donor's that
        the turn reads in place or copies (the worker copies them once they are verified)."""
        ready = self.workers.ready.get(r.worker)
        tiers = [t for t, bl in plan.restore.items() if bl]
        return ready is not None and ready.restore_overlap and len(tiers) == 1 and tiers[0] in ("host", "disk")

    def _dispatched(self, r: RequestState, ans: AskAnswered) -> None:
        """A pipelined restore's MoveRequested is committed and its command sent: the Generate goes
        now, naming the move. Refused, invalid or not one move: as a plain restore that failed.
        From here the worker answers for the restore: if it fails, so does this request (its
        error to the client, its pages freed by the worker and recorded as for any error)."""
        if r.phase == "done":
            return
        refused = any(type(e) is ev.MoveRefused for e in ans.events)
        if ans.error is not None or refused or len(ans.move_ids) != 1 or any(type(e) in TERMINAL for e in ans.events):
            self._restored(r, ans)
            return
        if r.cancelled:
            self.end_unstarted(r)
            return
        self.restores["pipelined"] += 1
        a = r.admit
        self._landing[ans.move_ids[0]] = ((r.worker, a.shared_from, list(a.shared), True) if a.shared
                                          else (r.worker, r.session, list(a.reused), False))
        self._run(r, awaits_move=ans.move_ids[0])

    def on_outcome(self, event) -> None:
        """A terminal event of a move (every one recorded). A pipelined restore that failed or was
        rejected: the worker failed the turn that read it (its error reached the client, its own
        pages were freed and recorded); its session gives up the prefix it could not bring back,
        as a plain restore that failed does, so the next turn computes it instead of failing again.
        A donor's shared pages are given up only when their bytes failed (MoveFailed: unreadable or
        not what was parked), so no later turn reads them again; a rejected move left them as they were."""
        landing = self._landing.pop(event.move_id, None)
        if landing is None or type(event) is ev.MoveAcked:
            return
        if type(event) is ev.MoveStranded:          # no answer yet: it may still land (a late ack)
            self._landing[event.move_id] = landing
            return
        worker, session, pages, shared = landing
        if type(event) not in (ev.MoveFailed, ev.MoveRejected) or (shared and type(event) is not ev.MoveFailed):
            return
        wb = self.proc.state.blocks.get(worker, {})
        drop: dict[str, list[int]] = {}
        for b in pages:
            for t in (wb[b].tiers if b in wb else ()):
                drop.setdefault(t, []).append(b)
        log.warning("pipelined_restore_failed", move_id=event.move_id, session=session, outcome=type(event).__name__)
        sched = self.workers.sched
        sched.decisions["restore_failed"] = sched.decisions.get("restore_failed", 0) + 1
        sched.forget_blocks(worker, set(pages))
        self.asker.release(worker, drop, "restore_failed", session)

    def _wait(self, r: RequestState, plan: Wait, now: int) -> None:
        if r.phase != "waiting":
            if len(self.requests.waiting) >= self.max_waiting:
                self.refuse(r, 503, "server_overloaded", f"{len(self.requests.waiting)} requests are already waiting")
                return
            r.phase, r.wait_since_ns = "waiting", now
            self.requests.wait(r)
            log.info("request_waiting", request_id=r.request_id, reason=plan.reason, park=plan.park)
            # once per request: the retries that follow change nothing the ledger needs to know
            self.proc.record(ev.RequestQueued(request_id=r.request_id, session=r.session, worker=r.worker,
                                              prompt_tokens=len(r.token_ids), waiting_for=plan.reason,
                                              needed_blocks=plan.needed_blocks, free_blocks=plan.free_blocks,
                                              parks=list(plan.park)), correlation=r.request_id)
        r.wait_code, r.wait_reason = plan.code, plan.reason
        for s in plan.park:
            if s not in r.parks_asked and self._park_backoff.get(s, 0) <= now:
                r.parks_asked.add(s)
                self.asker.ask(AskMove(ask_id=self.asker.new_id("park"), kind="park", worker=r.worker, session=s),
                               "serving", lambda ans, r=r, s=s: self._parked_for(r, s, ans))

    def _parked_for(self, r: RequestState, session: str, ans: AskAnswered) -> None:
        """A park asked to make room answered. Refused (the host is full) or invalid: ask again
        only after a backoff, never in a loop of refusals."""
        if ans.error is not None or any(type(e) is not ev.MoveAcked for e in ans.events if type(e) in TERMINAL
                                        or type(e) is ev.MoveRefused):
            log.info("park_for_room_failed", request_id=r.request_id, session=session, error=ans.error,
                     detail=ans.detail, events=[type(e).__name__ for e in ans.events])
            r.parks_asked.discard(session)
            self._park_backoff[session] = time.time_ns() + int(self.park_backoff_s * 1e9)

    def _restored(self, r: RequestState, ans: AskAnswered) -> None:
        if r.phase == "done":           # ended while its pages were restored (the server stopped)
            return
        acked = [e for e in ans.events if type(e) is ev.MoveAcked or type(e) is ev.CopiesReleased]
        ok = ans.error is None and len(acked) == len(ans.move_ids) > 0 and all(
            type(e) is ev.CopiesReleased or e.checksum_ok for e in acked)      # a release checks no bytes
        if r.cancelled:
            self.end_unstarted(r)
            return
        if not ok:
            why = ans.error or ", ".join(type(e).__name__ for e in ans.events) or "no answer"
            log.warning("restore_failed_recomputing", request_id=r.request_id, session=r.session, why=why,
                        detail=ans.detail)
            admit = self.workers.sched.recompute_instead(self.proc.state, r.request_id)
            self.asker.release(r.worker, admit.drop, "restore_failed", r.session)
            r.admit = admit
        else:
            self.restores["plain"] += 1
        self._run(r)

    def _run(self, r: RequestState, awaits_move: str = "") -> None:
        a: Admit = r.admit
        if r.cancelled:
            self.end_unstarted(r)
            return
        r.phase = "running"
        sampling = msgspec.structs.replace(r.req.sampling, max_tokens=r.max_tokens)
        cmd = Generate(request_id=r.request_id, session=r.session, token_ids=r.token_ids, block_ids=a.blocks,
                       num_cached_tokens=a.num_cached_tokens, sampling=sampling,
                       free_on_finish=r.session is None, copy_from=list(a.shared) if a.copied else [],
                       awaits_move=awaits_move, model=self._model_arg(r.worker, r.req.model))
        failed = self._send(r.worker, cmd)
        if failed is not None:
            self.end_unstarted(r, reason="error", error=failed)
            return
        r.accept()

    def _model_arg(self, worker: int, model: str) -> str:
        """The model a worker's Tokenize/Generate names: the request's, when the worker serves
        several (it refuses one for weights its arena does not hold); "" (the resident one) else."""
        ready = self.workers.ready.get(worker)
        return model if ready is not None and len(ready.models) > 1 else ""

    def _send(self, worker: int, msg) -> BackendError | None:
        """Hand a request's message to its worker; the error to answer the request with when that
        fails. NOTE: a message that cannot even be encoded must still be answered: raised here, it
        would leave the request waiting for a reply that never comes."""
        try:
            if self.proc.send_to_worker(worker, msg):
                return None
        except Exception as e:  # noqa: BLE001
            log.warning("request_not_sent", request_id=msg.request_id, worker=worker, error=repr(e))
            return BackendError(500, f"the request could not be handed to worker {worker}: {e}",
                                type="server_error", code="worker_send_failed")
        return BackendError(503, f"worker {worker} is unreachable", type="server_error", code="worker_unavailable")

    def end_unstarted(self, r: RequestState, reason: str | None = None, error: BackendError | None = None) -> None:
        """An admitted request that never reached the worker: finish it by the book, and answer it
        with ``error`` (by default: the client went away)."""
        why = reason or r.cancelled or "cancelled"
        self.proc.record(ev.RequestFinished(request_id=r.request_id, reason=why, completion_tokens=0),
                         correlation=r.request_id)
        self.workers.sched.finish(r.request_id, "cancelled", 0, time.time_ns())
        self.requests.forget(r)
        r.reject(error or BackendError(499, "the client went away", code="client_disconnected"))
        self.retry_soon()

    def refuse(self, r: RequestState, status: int, code: str, message: str, param: str | None = None,
               retry_after_s: int | None = None) -> None:
        self.proc.record(ev.RequestRefused(request_id=r.request_id, reason=f"{code}: {message}"),
                         correlation=r.request_id)
        self.requests.forget(r)
        r.reject(BackendError(status, message, type="server_error" if status >= 500 else "invalid_request_error",
                              code=code, param=param, retry_after_s=retry_after_s))

    # ------------------------------------------------------------------ waiting for room
    def retry_soon(self) -> None:
        """Room may have appeared (a move ended, pages were freed, a request finished): plan the
        waiting requests again, once, after the handler that noticed it."""
        if self.requests.waiting and not self._retry_posted:
            self._retry_posted = True
            self.proc.call(lambda _proc: self.retry_waiting())

    def retry_waiting(self) -> None:
        self._retry_posted = False
        for r in list(self.requests.waiting):
            if r.phase == "waiting" and not r.cancelled:
                self.admit(r)

    def end_waiting(self, r: RequestState, why: str, error: BackendError, *, client_left: bool = False) -> None:
        """A queued request that will never be admitted (its client left, its worker was lost, the
        server stops): closed in the ledger, so no ``RequestQueued`` stays open, and answered. A
        client that left finished it; anything else refused it."""
        if client_left:
            self.proc.record(ev.RequestFinished(request_id=r.request_id, reason=why, completion_tokens=0),
                             correlation=r.request_id)
        else:
            self.proc.record(ev.RequestRefused(request_id=r.request_id, reason=f"{why}: {error.message}"),
                             correlation=r.request_id)
        self.requests.forget(r)
        r.reject(error)

    def stop_waiting(self, reason: str) -> None:
        """The server stops: every request still queued is refused by the book (503, retryable elsewhere)."""
        for r in list(self.requests.waiting):
            if r.phase == "waiting":
                self.end_waiting(r, "server_stopped", BackendError(
                    503, f"the server stopped ({reason}) before room came for this request",
                    type="server_error", code="server_stopped"))

    def expire_waits(self, now_ns: int) -> None:
        """Refuse the requests that waited for room longer than ``wait_timeout_s``."""
        for r in list(self.requests.waiting):
            if now_ns - r.wait_since_ns > self.wait_timeout_ns:
                self.refuse(r, 503, r.wait_code, f"waited {self.wait_timeout_ns // 10**9} s: {r.wait_reason}")
