"""Running requests: the tokens a worker generates, on to the API's stream, and their end
(finished, cancelled, or lost with the worker), each recorded. Loop thread only.

    TokensGenerated ─► BlocksCommitted (pages the step filled) ─► a chunk to the stream
    the last one    ─► BlocksFreed (finished | disconnected | error) ─► RequestFinished ─► the last chunk
    its worker lost or wedged ─► RequestFinished(error) ─► a last chunk saying 503, retry
"""
from __future__ import annotations

import time

import structlog

from residency.control.scheduler.admission import RETRY_AFTER_S, Admission
from residency.control.scheduler.core import Admit
from residency.control.scheduler.port import BackendError, Chunk, Usage
from residency.control.scheduler.requests import RequestTable
from residency.control.scheduler.retain import is_retained
from residency.control.scheduler.session_book import SessionBook
from residency.control.scheduler.workers import ServingWorkers
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, TokensGenerated

log = structlog.get_logger("control.serving")
FREE_REASON = {"stop": "finished", "length": "finished", "error": "error"}


class GenerationStreams:
    def __init__(self, proc, workers: ServingWorkers, requests: RequestTable, admission: Admission,
                 book: SessionBook):
        self.proc = proc
        self.workers = workers
        self.requests = requests
        self.admission = admission
        self.book = book
        self.orphans_cancelled: set[str] = set()    # told to cancel; forgotten at their last report

    def on_tokens(self, link, msg: TokensGenerated) -> None:
        r = self.requests.get(msg.request_id)
        session = r.session if r is not None else None
        sched = self.workers.sched
        bb = self.proc.state.workers[link.worker].block_bytes
        if msg.blocks_written:
            if sched is not None:     # None: an adopted worker reports before serving is ready here
                sched.written(msg.request_id, msg.blocks_written, msg.keys_written)
            self.proc.record(ev.BlocksCommitted(worker=link.worker, session=session, tier="device",
                                                blocks=list(msg.blocks_written), keys=list(msg.keys_written),
                                                bytes=len(msg.blocks_written) * bb,
                                                session_tokens=self._session_tokens(r, msg)),
                             correlation=msg.request_id)
        if r is None:
            if msg.finish_reason is None:
                self._cancel_orphan(link.worker, msg.request_id)
                return
            self.orphans_cancelled.discard(msg.request_id)
            # a request this process no longer tracks still had pages on the worker, which freed
            # them: recorded, so the ledger's books match the worker's
            if msg.blocks_freed:
                self.proc.record(ev.BlocksFreed(worker=link.worker, tier="device", blocks=list(msg.blocks_freed),
                                                bytes=msg.bytes_freed, reason="orphaned"), correlation=msg.request_id)
            return
        r.num_generated += len(msg.token_ids)
        if msg.finish_reason is None:
            sched.progress(r.request_id, sched.positions_written(r.request_id, r.num_generated, len(r.token_ids)))
            if msg.token_ids or msg.text:
                r.push(Chunk(text=msg.text, token_ids=list(msg.token_ids), logprobs=list(msg.logprobs)))
            return
        reason, error = msg.finish_reason, msg.error
        if reason == "cancelled" and r.rank_failed is not None and not r.cancelled:
            reason, error = "error", r.rank_failed      # cancelled here because a peer rank failed it
        why = (r.cancelled or "cancelled") if reason == "cancelled" else FREE_REASON.get(reason, reason)
        if msg.blocks_freed:
            self.proc.record(ev.BlocksFreed(worker=link.worker, tier="device", blocks=list(msg.blocks_freed),
                                            bytes=msg.bytes_freed, reason=why), correlation=msg.request_id)
        self.proc.record(ev.RequestFinished(request_id=r.request_id, reason=reason if reason != "cancelled" else why,
                                            completion_tokens=r.num_generated), correlation=r.request_id)
        a: Admit = r.admit
        sched.finish(r.request_id, reason, len(r.token_ids) + max(0, r.num_generated - 1), time.time_ns())
        self.requests.forget(r)
        usage = Usage(prompt_tokens=len(r.token_ids), completion_tokens=r.num_generated,
                      cached_tokens=a.num_cached_tokens, restored_tokens=a.restored_tokens,
                      computed_tokens=msg.num_computed_tokens,
                      shared_tokens=len(a.shared) * sched.cfg.page_tokens)
        r.push(Chunk(text=msg.text, token_ids=list(msg.token_ids), finish_reason=reason, usage=usage,
                     error=error, logprobs=list(msg.logprobs)))
        if is_retained(r.session):
            self.book.evict_retained()
        self.admission.retry_soon()

    def _cancel_orphan(self, worker: int, request_id: str) -> None:
        """A sequence still running for a request nobody here waits for (its control process was
        lost; recovery closed the request): cancelled once, so the worker stops computing it and
        frees its pages (their BlocksFreed comes with its last report)."""
        if request_id not in self.orphans_cancelled:
            self.orphans_cancelled.add(request_id)
            log.info("orphan_cancelled", request_id=request_id, worker=worker)
            self.proc.send_to_worker(worker, CancelGenerate(request_id=request_id, reason="control_lost"))

    def _session_tokens(self, r, msg: TokensGenerated) -> int | None:
        """Positions the session's pages hold once ``msg``'s pages are in; None outside a session
        and for a turn that ends without keeping them."""
        if r is None or r.session is None or msg.finish_reason not in (None, "stop", "length"):
            return None
        return self.workers.sched.positions_written(r.request_id, r.num_generated + len(msg.token_ids),
                                                    len(r.token_ids))

    def cancel(self, request_id: str, reason: str) -> None:
        r = self.requests.get(request_id)
        if r is None or r.cancelled:
            return
        r.cancelled = reason
        if r.phase == "running":
            self.proc.send_to_worker(r.worker, CancelGenerate(request_id=request_id, reason=reason))
        elif r.phase == "waiting":               # queued in the ledger: closed there too
            self.admission.end_waiting(r, reason, BackendError(499, "the client went away", code="client_disconnected"),
                                       client_left=True)
        elif r.phase in ("new", "tokenizing"):
            self.requests.forget(r)              # never admitted nor queued: nothing to record
            r.reject(BackendError(499, "the client went away", code="client_disconnected"))
        # restoring: the restore's answer sees it and ends the request (Admission)

    def worker_lost(self, worker: int) -> None:
        """End the requests the worker had: a running one with an error chunk (recorded), one
        not yet admitted with a 503; both retryable."""
        self._end_on_worker(worker, "worker_lost", f"worker {worker} was lost", cancel=False)

    def worker_wedged(self, worker: int, why: str) -> list[str]:
        """The worker is up but its engine does not progress: answer its running requests as a
        lost worker's are, and cancel them there so it frees their pages should it wake up (the
        BlocksFreed then recorded is ``orphaned``). Returns the requests answered."""
        return self._end_on_worker(worker, "worker_wedged", f"worker {worker} is wedged: {why}", cancel=True,
                                   phases=("running",))

    def worker_stopped(self, worker: int, code: str, message: str) -> list[str]:
        """The worker serves no more (its group stopped): every request it had is answered 503 with
        ``code``, and a running one cancelled there so its pages are freed."""
        return self._end_on_worker(worker, code, message, cancel=True)

    def _end_on_worker(self, worker: int, code: str, message: str, *, cancel: bool,
                       phases: tuple[str, ...] = ("running", "tokenizing", "waiting")) -> list[str]:
        ended = []
        for r in self.requests.on_worker(worker):
            if r.phase not in phases:
                continue
            ended.append(r.request_id)
            if r.phase == "running":
                if cancel:
                    self.proc.send_to_worker(worker, CancelGenerate(request_id=r.request_id, reason=code))
                r.push(Chunk(text="", finish_reason="error", error=message, status=503, code=code,
                             retry_after_s=RETRY_AFTER_S,
                             usage=Usage(prompt_tokens=len(r.token_ids), completion_tokens=r.num_generated)))
                self.proc.record(ev.RequestFinished(request_id=r.request_id, reason="error",
                                                    completion_tokens=r.num_generated), correlation=r.request_id)
                self.workers.sched.finish(r.request_id, "error", 0, time.time_ns())
                self.requests.forget(r)
            elif r.phase == "waiting":       # queued in the ledger: closed there too
                self.admission.end_waiting(r, code, BackendError(
                    503, message, type="server_error", code=code, retry_after_s=RETRY_AFTER_S))
            else:
                self.requests.forget(r)
                r.reject(BackendError(503, message, type="server_error", code=code, retry_after_s=RETRY_AFTER_S))
        return ended

    def stop(self, reason: str) -> None:
        """The server stops with requests still in hand (the drain was cut): each admitted one is
        closed in the ledger (``RequestFinished(reason="server_stopped")``) before ``ServerStopped``,
        so none stays open there, and every client gets an answer instead of a reset connection.
        Runs after ``Admission.stop_waiting`` (the queued ones are closed there)."""
        message = f"the server stopped ({reason}) before this request finished"
        for r in list(self.requests.by_id.values()):
            if r.phase == "running":
                r.push(Chunk(text="", finish_reason="error", error=message, status=503, code="server_stopped",
                             usage=Usage(prompt_tokens=len(r.token_ids), completion_tokens=r.num_generated)))
                self.proc.record(ev.RequestFinished(request_id=r.request_id, reason="server_stopped",
                                                    completion_tokens=r.num_generated), correlation=r.request_id)
                self.workers.sched.finish(r.request_id, "error", 0, time.time_ns())
                self.requests.forget(r)
            elif r.phase == "restoring":    # admitted, never started: its restore's answer will find it done
                self.admission.end_unstarted(r, "server_stopped", BackendError(
                    503, message, type="server_error", code="server_stopped"))
            elif r.phase in ("new", "tokenizing"):     # not in the ledger yet: only answered
                self.requests.forget(r)
                r.reject(BackendError(503, message, type="server_error", code="server_stopped"))
