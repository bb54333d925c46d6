"""Asks to the control process (the HTTP API and ``residency ctl`` over the ask socket) and their answers.

    AskMove          resolve ─► fund ─► MoveRequested per move, or MoveRefused with the arithmetic
    AskReleaseBlocks a release: MoveRequested(src == dst), answered by BlocksFreed
    AskSetBudget     BudgetSet (checked first)
    AskCommitBlocks  block ids allocated here; CommitBlocks to the worker; BlocksCommitted on its answer
    AskStatus        the live state and health, at once
An answer leaves only once everything recorded for its ask is committed (``_answer_after``).

``Asks`` is a part of ``ControlProc`` (control/proc.py), run on its loop thread. It reads and sets the
loop's fields made by ``StartStop._recover``: ``state``, ``book``, ``busy``, ``_answers``,
``_commits_pending``, ``_next_block``, ``_by_worker``, ``_asks``, ``_recorder``, ``metrics``.
"""
from __future__ import annotations

import time
from typing import Callable

import zmq
import structlog

from residency.events import catalog as ev
from residency.events.commands import BlocksWritten, CommandFailed, CommitBlocks
from residency.events.asks import (
    AskAnswered, AskCommitBlocks, AskMove, AskReleaseBlocks, AskSetBudget, AskStatus, StatusReport,
)
from residency.control import budget, moves
from residency.control.errors import ControlError, LedgerDiverged
from residency.control.links import WorkerLink
from residency.control.policy import release
from residency.control.state import encode_state, state_hash
from residency.control.transport import INVALID_ASK, TransportError

log = structlog.get_logger("control.asking")
S = 1_000_000_000


class Asks:
    """Asks and answers (a part of ControlProc; loop thread only)."""

    def _recv_ask(self) -> bool:
        try:
            identity, msg = self._asks.recv()
        except zmq.Again:
            return False
        except TransportError as e:
            log.warning("bad_ask", error=e.name, detail=e.detail)
            self._asks.send(e.identity, e.reply())
            return True
        self._on_ask_guarded(msg, "operator", lambda reply, _id=identity: self._asks.send(_id, reply), "socket")
        return True

    def _on_ask_guarded(self, msg, asker: str, reply: Callable, off_loop: str = "") -> None:
        try:
            self._on_ask(msg, asker, reply, off_loop)
        except (ControlError, LedgerDiverged):
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged once; the loop goes on
            self.metrics["ask_failed"] += 1
            log.exception("ask_failed", ask=type(msg).__name__, asker=asker)
            reply(AskAnswered(ask_id=getattr(msg, "ask_id", ""), error="internal_error", detail=repr(e)))

    def _on_ask(self, msg, asker: str, reply: Callable, off_loop: str = "") -> None:
        ask_id = getattr(msg, "ask_id", "")
        self._ask_ns = time.time_ns()
        if type(msg) is AskStatus:
            reply(self.status_report(ask_id, msg.include_state))
            return
        waiter = moves.AskWaiter(ask_id, lambda events, mids, error, detail: reply(AskAnswered(
            ask_id=ask_id, events=[e for _, e in events], seqs=[s for s, _ in events], move_ids=mids,
            error=error, detail=detail)), wait=getattr(msg, "wait", True))
        waiter.off_loop = off_loop
        if self._stop_reason is not None:
            waiter.answer([], [], "shutting_down", "the control process is stopping")
            return
        try:
            if type(msg) is AskMove:
                self._ask_move(msg, f"{asker}:{msg.kind}", waiter)
            elif type(msg) is AskReleaseBlocks:
                proposal = release(f"{asker}:release", msg.worker, msg.tier, msg.blocks, msg.reason)
                moves.validate(self.state, proposal, self.busy.by_worker)
                self._request(proposal, waiter)
            elif type(msg) is AskSetBudget:
                problem = budget.check_budget(self.state, msg.worker, msg.tier, msg.floor_bytes, msg.ceiling_bytes)
                if problem:
                    raise moves.InvalidAsk(problem)
                e = ev.BudgetSet(worker=msg.worker, tier=msg.tier, floor_bytes=msg.floor_bytes,
                                 ceiling_bytes=msg.ceiling_bytes)
                waiter.events.append((self._record(e, causation=f"{asker}:budget"), e))
            elif type(msg) is AskCommitBlocks:
                self._ask_commit(msg, waiter)
            else:
                raise moves.InvalidAsk(f"{type(msg).__name__} is not an ask")
        except moves.InvalidAsk as e:
            log.info("invalid_ask", ask_id=ask_id, asker=asker, detail=str(e))
            waiter.answer([], [], INVALID_ASK, str(e))
            return
        if not waiter.wait and waiter.move_ids:
            waiter.open.clear()
            for mid in waiter.move_ids:
                self.book.waiters.pop(mid, None)
        if waiter.done:
            self._answer_after(waiter)

    def _ask_move(self, msg: AskMove, asker: str, waiter: moves.AskWaiter) -> None:
        if self.cfg.wake_lane_on_ask and msg.blocks and msg.kind != "release" and not self._host_kept_awake():
            self._wake_lane(msg.worker, len(msg.blocks))
        proposals = moves.resolve(self.state, msg, asker, self.busy.by_worker)
        refusal = moves.fund(self.state, proposals, self.reserved_bytes())
        if refusal is not None:
            e = refusal.event(asker, msg.session)
            log.info("move_refused", asker=asker, worker=refusal.worker, tier=refusal.tier,
                     asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
            waiter.events.append((self._record(e, correlation=msg.session, causation=msg.ask_id or None), e))
            return
        for a in proposals:
            self._request(a, waiter)

    def _ask_commit(self, msg: AskCommitBlocks, waiter: moves.AskWaiter) -> None:
        ws = self.state.workers.get(msg.worker)
        link = self._by_worker.get(msg.worker)
        if ws is None or not ws.alive or link is None:
            raise moves.InvalidAsk(f"worker {msg.worker} is not serving")
        if msg.num_blocks <= 0:
            raise moves.InvalidAsk("num_blocks must be > 0")
        acc = ws.tiers[msg.tier]
        nbytes = msg.num_blocks * ws.block_bytes
        pending = sum(c[4] for c in self._commits_pending.values() if c[1] == msg.worker and c[2] == msg.tier)
        room = budget.limit_bytes(acc) - acc.used_bytes - acc.inflight_in_bytes - pending
        if nbytes > room:
            raise moves.InvalidAsk(f"no room for {nbytes} bytes on {msg.tier} of worker {msg.worker}: "
                                   f"limit {budget.limit_bytes(acc)} - used {acc.used_bytes} - in flight "
                                   f"{acc.inflight_in_bytes} - committing {pending} = {room}")
        blocks = self.allocate_block_ids(msg.worker, msg.num_blocks)
        self._num_refs += 1
        ref = f"c-{self.epoch:x}-{self._num_refs}"
        self._commits_pending[ref] = (waiter, msg.worker, msg.tier, msg.session, nbytes,
                                      time.monotonic_ns() + int(self.cfg.moves.deadline_base_s * S))
        waiter.open.add(ref)
        self._send(link, CommitBlocks(request_id=ref, session=msg.session, tier=msg.tier, blocks=blocks, seed=msg.seed))

    def allocate_block_ids(self, worker: int, n: int) -> list[int]:
        """``n`` block ids never used on ``worker`` (the one allocator: commits and the serving
        path's pages). Loop thread only."""
        first = self._next_block.get(worker)
        if first is None:
            # NOTE: a gap after a restart: a commit the last incarnation sent but never recorded may
            # have used ids above the ledger's highest; never hand those out again.
            top = max(self.state.blocks.get(worker, {}) or [-1])
            first = ((top + 1) // (1 << 20) + 1) * (1 << 20) if self.recovered and self.recovered.crashed else top + 1
        self._next_block[worker] = first + n
        return list(range(first, first + n))

    def _on_written(self, link: WorkerLink, msg: BlocksWritten) -> None:
        entry = self._commits_pending.pop(msg.request_id, None)
        session = entry[3] if entry else None
        e = ev.BlocksCommitted(worker=link.worker, session=session, tier=msg.tier, blocks=list(msg.blocks),
                               keys=list(msg.keys), bytes=msg.bytes)
        seq = self._record(e, correlation=session, causation=msg.request_id)
        if entry is not None:
            waiter = entry[0]
            waiter.events.append((seq, e))
            waiter.open.discard(msg.request_id)
            if waiter.done:
                self._answer_after(waiter)

    def _on_command_failed(self, link: WorkerLink, msg: CommandFailed) -> None:
        log.warning("command_failed", worker=link.worker, ref=msg.ref, error=msg.error, detail=msg.detail)
        entry = self._commits_pending.pop(msg.ref, None)
        if entry is not None:
            entry[0].answer([], [], msg.error, msg.detail)
            return
        mv = self.state.inflight.get(msg.ref)
        if mv is not None and mv.worker == link.worker:
            self._settle(msg.ref, ev.MoveFailed(move_id=msg.ref, worker=link.worker,
                                                error=f"{msg.error}: {msg.detail}", bytes_moved=None))

    def _answer_after(self, waiter: moves.AskWaiter) -> None:
        """Answer once everything recorded for the ask is committed."""
        need = max((s for s, _ in waiter.events), default=0)
        if not waiter.wait and waiter.move_ids:      # answered once its MoveRequesteds are committed
            mine = set(waiter.move_ids)
            need = max([need] + [s for s, req in self.book.awaiting_commit if req.move_id in mine])
        self._answers.append((need, waiter))

    def _answer_off_loop(self, fold_blocks: int = 0) -> None:
        """Answer now the committed askers that are off the loop's thread (a socket, another
        thread's future); the others stay queued for ``_commits``.

        NOTE: a thread of this process woken by its answer still needs the GIL, which the loop
        would hold through the fold that follows: after answering one, when that fold is of at
        least ``answer_yield_min_blocks`` blocks, the loop sleeps ``answer_yield_us`` so the asker
        takes its answer first (measured on the 2-vCPU VM, a 1024-block move's overhead p50 0.89 ms
        without, 0.59 ms with 50 us). A small fold is quicker than the sleep (one-block round
        trips back to back: p50 0.46 ms without, 0.62 ms with it)."""
        committed, answers = self._recorder.committed, self._answers
        if not any(need <= committed and w.off_loop for need, w in answers):
            return
        later = [(need, w) for need, w in answers if need > committed or not w.off_loop]
        now = [w for need, w in answers if need <= committed and w.off_loop]
        answers.clear()
        answers.extend(later)
        for w in now:
            self._answer(w)
        if (self.cfg.answer_yield_us and fold_blocks >= self.cfg.answer_yield_min_blocks
                and any(w.off_loop == "thread" for w in now)):
            self.metrics["answer_yields"] += 1
            time.sleep(self.cfg.answer_yield_us / 1e6)

    def _answer(self, waiter: moves.AskWaiter) -> None:
        if self.traces.keep:
            for mid in waiter.move_ids:
                self.traces.mark(mid, "answered")
        waiter.events.sort(key=lambda p: p[0])
        waiter.answer(waiter.events, waiter.move_ids, None, "")

    def status_report(self, ask_id: str = "", include_state: bool = True) -> StatusReport:
        h = self.health()
        metrics = dict(h.metrics)
        metrics.update(committed_seq=float(self._recorder.committed), workers_linked=float(len(self._links)),
                       epoch=float(self.epoch))
        return StatusReport(ask_id=ask_id, last_seq=self.state.last_seq, state_hash=state_hash(self.state),
                            healthy=h.healthy, problems=h.problems, metrics=metrics,
                            state=encode_state(self.state) if include_state else b"")
