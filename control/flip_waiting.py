"""Requests held for a model no worker serves now (the Flipper's gate; loop thread only).

A request naming a model that no alive worker serves is held: it starts over (``begin``) once one
does, or is answered 503 after ``wait_ns`` naming what it waited for (the sleep, the flip, a model
not resident). A held request is in hand (``RequestTable``): a client that leaves cancels it, the
drain at stop counts it.

While it waits it is tokenized: a worker that lists its model (``ServingReady.models``) tokenizes
for it with that model's own tokenizer, weights or not (docs/flip.md). The answer gets the checks
of any Tokenized (``check``: Admission's ``check_tokens``); a request refused there is answered
400 at once and never waits for the flip, one that passes keeps its Tokenized and is not tokenized
again. Only then does it count for the flip policy (``backlog``), so a request that would be
refused never causes a flip. A worker that cannot tokenize for the model (an older one, whose
answer is ``model_not_resident``, or one lost meanwhile) leaves the request as before: it is
tokenized once its model is served.

    hold ─► Tokenize(model) ─► on_tokenized ─► refused: RequestRefused (400)
                                             ─► kept: waits, counted by the policy ─► release ─► begin (no Tokenize)
                                             ─► not here: waits, tokenized after release
"""
from __future__ import annotations

import time
from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.events.commands import Tokenize, Tokenized

log = structlog.get_logger("control.flip")
S = 1_000_000_000
# a worker's answer saying it cannot tokenize for that model now (not that the prompt is wrong)
NOT_HERE = ("model_not_resident", "model_unknown", "weights_asleep", "weights_unbound")


class HeldRequests:
    """The requests held for a model, in arrival order, what each waits for, and the Tokenize
    answers they still wait for."""

    def __init__(self, proc, requests, wait_s: float, tokenize_wait_s: float = 5.0):
        self.proc = proc
        self.requests = requests          # RequestTable
        self.wait_ns = int(wait_s * S)
        # NOTE: a Tokenize unanswered this long (a worker that stalls) no longer keeps its request
        # out of the policy's backlog or held once its model is served: it is tokenized after all
        self.tokenize_wait_ns = int(tokenize_wait_s * S)
        self.held: list = []              # RequestState held for a model, in arrival order
        self.tokenizing: dict[str, tuple[int, int]] = {}    # request_id -> (worker asked, when: monotonic ns)
        self.begin: Callable = lambda r: None         # Admission.begin: a released request starts over
        self.refuse: Callable = lambda r, status, code, message, param=None, retry_after_s=None: None
        self.left: Callable = lambda r: None          # a held request whose client went away (closed in the ledger)
        self.check: Callable = lambda r, msg, worker: 0     # Admission.check: TokensRefused, or the max_tokens
        self.settled: Callable[[], None] = lambda: None    # the Flipper: release, and ask the policy again
        self.alive: Callable[[int], bool] = lambda worker: True

    def __bool__(self) -> bool:
        return bool(self.held)

    def hold(self, r, code: str, reason: str, worker: int, tokenizers: list[int] = ()) -> None:
        """Hold ``r`` (once): recorded as queued, waiting for ``code: reason``; the first of
        ``tokenizers`` (alive workers that list its model) is asked to tokenize it meanwhile,
        unless it was tokenized already (it starts over after a flip moved its model out)."""
        if r.phase == "held":
            return
        r.phase, r.wait_since_ns = "held", time.monotonic_ns()
        self.held.append(r)
        self.requests.add(r)
        r.wait_code, r.wait_reason = code, reason
        self.proc.record(ev.RequestQueued(request_id=r.request_id, session=r.session, worker=worker, prompt_tokens=0,
                                          waiting_for=f"{code}: {reason}"), correlation=r.request_id)
        log.info("request_held_for_model", request_id=r.request_id, model=r.req.model, code=code)
        if tokenizers and r.tokenized is None:
            self._tokenize(r, tokenizers[0])

    def _tokenize(self, r, worker: int) -> None:
        req = r.req
        msg = Tokenize(request_id=r.request_id, messages=req.messages, prompt=req.prompt,
                       prompt_token_ids=req.prompt_token_ids, model=req.model)
        try:
            sent = self.proc.send_to_worker(worker, msg)
        except Exception as e:  # noqa: BLE001 - not sent: tokenized after the flip, as when none can
            log.warning("held_tokenize_not_sent", request_id=r.request_id, worker=worker, error=repr(e))
            return
        if sent:
            self.tokenizing[r.request_id] = (worker, time.monotonic_ns())

    def on_tokenized(self, r, worker: int, msg: Tokenized) -> None:
        """The answer to the Tokenize sent while ``r`` is held (any other is not ours: ignored)."""
        asked = self.tokenizing.get(r.request_id)
        if asked is None or asked[0] != worker or r not in self.held:
            return
        del self.tokenizing[r.request_id]
        if r.cancelled:
            self._drop(r)
            self.left(r)
            return
        code = (msg.error or "").partition(": ")[0]
        if (msg.error is not None and code in NOT_HERE) or not self.alive(worker):    # its card may be gone too
            log.info("held_tokenize_not_here", request_id=r.request_id, worker=worker, error=msg.error)
            self.settled()
            return
        verdict = self.check(r, msg, worker)
        if not isinstance(verdict, int):
            log.info("held_request_refused", request_id=r.request_id, model=r.req.model, code=verdict.code)
            self._drop(r)
            self.refuse(r, verdict.status, verdict.code, verdict.message, verdict.param)
            return
        r.tokenized = msg
        log.info("held_request_tokenized", request_id=r.request_id, model=r.req.model, worker=worker,
                 prompt_tokens=len(msg.token_ids))
        self.settled()

    def _out(self, r, now_ns: int) -> bool:
        """Whether ``r``'s Tokenize is still worth waiting for."""
        asked = self.tokenizing.get(r.request_id)
        return asked is not None and now_ns - asked[1] <= self.tokenize_wait_ns and self.alive(asked[0])

    def _drop(self, r) -> None:
        self.held.remove(r)
        self.tokenizing.pop(r.request_id, None)

    def backlog(self, now_ns: int | None = None) -> dict[str, list[int]]:
        """model -> when each request held for it began to wait (monotonic ns); a request whose
        Tokenize is out is not counted yet (it may be refused)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        out: dict[str, list[int]] = {}
        for r in self.held:
            if not self._out(r, now):
                out.setdefault(r.req.model, []).append(r.wait_since_ns)
        return out

    def release(self, serving: Callable[[str], list[int]]) -> None:
        """Start over every held request whose model a worker serves now (one whose Tokenize is
        out starts over with its answer)."""
        now = time.monotonic_ns()
        for r in list(self.held):
            if r.cancelled:
                self._drop(r)
                self.left(r)
            elif serving(r.req.model) and not self._out(r, now):
                self._drop(r)
                r.phase = "new"
                self.begin(r)

    def expire(self, now_ns: int, why: Callable[[str], tuple[str, str]]) -> None:
        """Answer 503 those that waited longer than ``wait_ns``, naming what they waited for."""
        for r in list(self.held):
            if r.cancelled or now_ns - r.wait_since_ns > self.wait_ns:
                self._drop(r)
                if r.cancelled:
                    self.left(r)
                    continue
                code, reason = why(r.req.model)
                self.refuse(r, 503, code, f"waited {self.wait_ns // S} s for {r.req.model!r}: {reason}",
                            retry_after_s=1)

    def stop(self, reason: str) -> None:
        for r in list(self.held):
            self._drop(r)
            self.refuse(r, 503, "server_stopped", f"the server stopped ({reason}) before {r.req.model!r} was served")


__all__ = ["HeldRequests", "NOT_HERE"]
