"""The ask handler: asks to the control process (the HTTP API, and ``residency ctl`` over the ask
socket) and their answers.

    AskMove          resolve ─► fund ─► MoveRequested per move, or MoveRefused with the arithmetic
    AskReleaseBlocks a release: MoveRequested(src == dst), answered by CopiesReleased
    AskSetBudget     BudgetSet (checked first)
    AskCommitBlocks  block ids allocated here; CommitBlocks to the worker; BlocksCommitted on its answer
    AskStatus        the live state and health, at once
    AskMemory        the memory view, once every worker's probe answered or timed out (control/memory_probes.py)
An answer leaves only once everything recorded for its ask is committed (``Answers``).
Loop thread only.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import zmq
import structlog

from residency.events import catalog as ev
from residency.events.asks import (
    AskAnswered, AskCommitBlocks, AskMemory, AskMove, AskReleaseBlocks, AskResize, AskSetBudget, AskStatus,
    StatusReport,
)
from residency.events.commands import BlocksWritten, CommandFailed, CommitBlocks
from residency.control import budget, moves
from residency.control.answers import Answers
from residency.control.config import ControlConfig
from residency.control.errors import ControlError, LedgerDiverged
from residency.control.lifecycle import MoveDispatcher
from residency.control.links import WorkerLink, WorkerRegistry
from residency.control.policy import release
from residency.control.recorder import Recorder
from residency.control.state import State, encode_state, state_hash
from residency.control.transport import INVALID_ASK, AskServer, TransportError

log = structlog.get_logger("control.asking")
S = 1_000_000_000


class PendingCommit:
    """A CommitBlocks sent for an ask, until the worker's BlocksWritten (or CommandFailed)."""

    __slots__ = ("waiter", "worker", "tier", "session", "nbytes", "deadline_ns")

    def __init__(self, waiter: moves.AskWaiter, worker: int, tier: str, session: str | None, nbytes: int,
                 deadline_ns: int):
        self.waiter, self.worker, self.tier, self.session = waiter, worker, tier, session
        self.nbytes, self.deadline_ns = nbytes, deadline_ns


class AskHandler:
    """Asks and answers (loop thread only)."""

    def __init__(self, cfg: ControlConfig, state: State, epoch: int, crashed: bool, recorder: Recorder,
                 server: AskServer | None, workers: WorkerRegistry, dispatcher: MoveDispatcher, answers: Answers,
                 metrics: collections.Counter, stopping: Callable[[], bool], health: Callable,
                 memory: Callable | None = None, dialer=None):
        self.cfg = cfg
        self.state = state
        self.epoch = epoch
        self.crashed = crashed           # the last incarnation did not stop cleanly (block ids, below)
        self.recorder = recorder
        self.server = server
        self.workers = workers
        self.dispatcher = dispatcher
        self.answers = answers
        self.metrics = metrics
        self.stopping = stopping
        self.health = health
        self.memory = memory             # AskMemory: memory(ask, reply) probes the workers, then replies
        self.dial = dialer               # control/dialing.py Dial: AskResize
        self.asked_ns = 0                # wall clock when the loop took the current ask (traces)
        self._pending: dict[str, PendingCommit] = {}    # commit ref -> its ask
        self._num_refs = 0
        self._next_block: dict[int, int] = {}
        # asks another part answers (ask type -> handler(msg, asker, waiter)): the handler adds a
        # ref to ``waiter.open`` while it works and calls ``finish(waiter, ref)`` when it is done
        self.extra: dict[type, Callable] = {}
        # a group's moves: each proposal for its leader and the same for every other rank
        # (control/groups.py); a worker alone: as they are
        self.expand: Callable[[list], list] = lambda proposals: proposals

    # ------------------------------------------------------------------ the ask socket
    def recv(self) -> bool:
        """Read and handle one ask from the socket; False when none is waiting."""
        try:
            identity, msg = self.server.recv()
        except zmq.Again:
            return False
        except TransportError as e:
            log.warning("bad_ask", error=e.name, detail=e.detail)
            self.server.send(e.identity, e.reply())
            return True
        self.handle(msg, "operator", lambda reply, _id=identity: self.server.send(_id, reply), "socket")
        return True

    # ------------------------------------------------------------------ asks
    def handle(self, msg, asker: str, reply: Callable, off_loop: str = "") -> None:
        """Handle one ask; ``reply`` gets its answer (after commit). An ask that fails here is
        answered with ``internal_error`` and logged once; the loop goes on."""
        try:
            self._handle(msg, asker, reply, off_loop)
        except (ControlError, LedgerDiverged):
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged once; the loop goes on
            self.metrics["ask_failed"] += 1
            log.exception("ask_failed", ask=type(msg).__name__, asker=asker)
            reply(AskAnswered(ask_id=getattr(msg, "ask_id", ""), error="internal_error", detail=repr(e)))

    def _handle(self, msg, asker: str, reply: Callable, off_loop: str) -> None:
        ask_id = getattr(msg, "ask_id", "")
        self.asked_ns = time.time_ns()
        if type(msg) is AskStatus:
            reply(self.status_report(ask_id, msg.include_state))
            return
        if type(msg) is AskMemory:
            if self.memory is None:
                reply(AskAnswered(ask_id=ask_id, error=INVALID_ASK, detail="this control keeps no memory view"))
            else:
                self.memory(msg, reply)
            return
        waiter = moves.AskWaiter(ask_id, lambda events, mids, error, detail: reply(AskAnswered(
            ask_id=ask_id, events=[e for _, e in events], seqs=[s for s, _ in events], move_ids=mids,
            error=error, detail=detail)), wait=getattr(msg, "wait", True))
        waiter.off_loop = off_loop
        if self.stopping():
            waiter.answer([], [], "shutting_down", "the control process is stopping")
            return
        try:
            if type(msg) is AskMove:
                self._ask_move(msg, f"{asker}:{msg.kind}", waiter)
            elif type(msg) is AskReleaseBlocks:
                proposals = self.expand([release(f"{asker}:release", msg.worker, msg.tier, msg.blocks, msg.reason,
                                                 msg.session)])
                for p in proposals:
                    moves.validate(self.state, p, self.dispatcher.busy.by_worker)
                for p in proposals:
                    self.dispatcher.request(p, waiter, self.asked_ns)
            elif type(msg) is AskSetBudget:
                problem = budget.check_budget(self.state, msg.worker, msg.tier, msg.floor_bytes, msg.ceiling_bytes)
                if problem:
                    raise moves.InvalidAsk(problem)
                e = ev.BudgetSet(worker=msg.worker, tier=msg.tier, floor_bytes=msg.floor_bytes,
                                 ceiling_bytes=msg.ceiling_bytes)
                waiter.events.append((self.recorder.record(e, causation=f"{asker}:budget"), e))
            elif type(msg) is AskCommitBlocks:
                self._ask_commit(msg, waiter)
            elif type(msg) in self.extra:
                self.extra[type(msg)](msg, asker, waiter)
            elif type(msg) is AskResize and self.dial is not None:
                self.dial.ask(msg, f"{asker}:resize", waiter)
                return          # the dial answers it after commit
            else:
                raise moves.InvalidAsk(f"{type(msg).__name__} is not an ask")
        except moves.NothingToMove as e:       # already where it was asked to go: done, said so
            log.info("nothing_to_move", ask_id=ask_id, asker=asker, detail=str(e))
            waiter.answer([], [], None, str(e))
            return
        except moves.InvalidAsk as e:
            log.info("invalid_ask", ask_id=ask_id, asker=asker, detail=str(e))
            waiter.answer([], [], INVALID_ASK, str(e))
            return
        if not waiter.wait and waiter.move_ids:
            waiter.open.clear()
            for mid in waiter.move_ids:
                self.dispatcher.book.waiters.pop(mid, None)
        if waiter.done:
            self.answers.after_commit(waiter)

    def _ask_move(self, msg: AskMove, origin: str, waiter: moves.AskWaiter) -> None:
        if msg.blocks and msg.kind != "release":
            self.dispatcher.wake_lane(msg.worker, len(msg.blocks))
        proposals = self.expand(moves.resolve(self.state, msg, origin, self.dispatcher.busy.by_worker))
        for p in proposals:               # a group's other ranks: their shards of the same blocks
            if p.worker != msg.worker:
                moves.validate(self.state, p, self.dispatcher.busy.by_worker)
        refusal = (self.dial.refuse_moves(proposals) if self.dial is not None else None) or moves.fund(
            self.state, proposals, self.dispatcher.reserved_bytes())
        if refusal is not None:
            e = refusal.event(origin, msg.session)
            log.info("move_refused", origin=origin, worker=refusal.worker, tier=refusal.tier,
                     asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
            waiter.events.append((self.recorder.record(e, correlation=msg.session, causation=msg.ask_id or None), e))
            return
        for p in proposals:
            self.dispatcher.request(p, waiter, self.asked_ns)

    def finish(self, waiter: moves.AskWaiter, ref: str) -> None:
        """An ``extra`` handler is done with ``ref``: the ask is answered once what it recorded commits."""
        waiter.open.discard(ref)
        if waiter.done:
            self.answers.after_commit(waiter)

    # ------------------------------------------------------------------ commits of new blocks
    def _ask_commit(self, msg: AskCommitBlocks, waiter: moves.AskWaiter) -> None:
        ws = self.state.workers.get(msg.worker)
        link = self.workers.by_worker.get(msg.worker)
        if ws is None or not ws.alive or link is None:
            raise moves.InvalidAsk(f"worker {msg.worker} is not serving")
        if msg.num_blocks <= 0:
            raise moves.InvalidAsk("num_blocks must be > 0")
        acc = ws.tiers[msg.tier]
        nbytes = msg.num_blocks * ws.block_bytes
        pending = sum(c.nbytes for c in self._pending.values() if c.worker == msg.worker and c.tier == msg.tier)
        room = budget.limit_bytes(acc) - acc.used_bytes - acc.inflight_in_bytes - pending
        if nbytes > room:
            raise moves.InvalidAsk(f"no room for {nbytes} bytes on {msg.tier} of worker {msg.worker}: "
                                   f"limit {budget.limit_bytes(acc)} - used {acc.used_bytes} - in flight "
                                   f"{acc.inflight_in_bytes} - committing {pending} = {room}")
        blocks = self.allocate_block_ids(msg.worker, msg.num_blocks)
        self._num_refs += 1
        ref = f"c-{self.epoch:x}-{self._num_refs}"
        self._pending[ref] = PendingCommit(waiter, msg.worker, msg.tier, msg.session, nbytes,
                                           time.monotonic_ns() + int(self.cfg.moves.deadline_base_s * S))
        waiter.open.add(ref)
        self.workers.send(link, CommitBlocks(request_id=ref, session=msg.session, tier=msg.tier, blocks=blocks,
                                             seed=msg.seed))

    def allocate_block_ids(self, worker: int, n: int) -> list[int]:
        """``n`` block ids never used on ``worker`` (the one allocator: commits and the serving
        path's pages)."""
        first = self._next_block.get(worker)
        if first is None:
            # NOTE: a gap after a restart: a commit the last incarnation sent but never recorded may
            # have used ids above the ledger's highest; never hand those out again.
            top = max(self.state.blocks.get(worker, {}) or [-1])
            first = ((top + 1) // (1 << 20) + 1) * (1 << 20) if self.crashed else top + 1
        self._next_block[worker] = first + n
        return list(range(first, first + n))

    def on_written(self, link: WorkerLink, msg: BlocksWritten) -> None:
        pc = self._pending.pop(msg.request_id, None)
        session = pc.session if pc else None
        e = ev.BlocksCommitted(worker=link.worker, session=session, tier=msg.tier, blocks=list(msg.blocks),
                               keys=list(msg.keys), bytes=msg.bytes)
        seq = self.recorder.record(e, correlation=session, causation=msg.request_id)
        if pc is not None:
            pc.waiter.events.append((seq, e))
            pc.waiter.open.discard(msg.request_id)
            if pc.waiter.done:
                self.answers.after_commit(pc.waiter)

    def on_command_failed(self, link: WorkerLink, msg: CommandFailed) -> None:
        log.warning("command_failed", worker=link.worker, ref=msg.ref, error=msg.error, detail=msg.detail)
        pc = self._pending.pop(msg.ref, None)
        if pc is not None:
            pc.waiter.answer([], [], msg.error, msg.detail)
            return
        mv = self.state.inflight.get(msg.ref)
        if mv is not None and mv.worker == link.worker:
            self.dispatcher.settle(msg.ref, ev.MoveFailed(move_id=msg.ref, worker=link.worker,
                                                          error=f"{msg.error}: {msg.detail}", bytes_moved=None))

    def watch_commits(self) -> None:
        """A commit the worker never answered is answered ``commit_timeout`` at its deadline."""
        if self._pending:
            now = time.monotonic_ns()
            for ref in [r for r, c in self._pending.items() if c.deadline_ns < now]:
                waiter = self._pending.pop(ref).waiter
                log.warning("commit_timeout", ref=ref)
                waiter.answer([], [], "commit_timeout", f"the worker did not answer commit {ref}")

    # ------------------------------------------------------------------ status
    def status_report(self, ask_id: str = "", include_state: bool = True) -> StatusReport:
        h = self.health()
        metrics = dict(h.metrics)
        metrics.update(committed_seq=float(self.recorder.committed), workers_linked=float(self.workers.num_links),
                       epoch=float(self.epoch))
        return StatusReport(ask_id=ask_id, last_seq=self.state.last_seq, state_hash=state_hash(self.state),
                            healthy=h.healthy, problems=h.problems, metrics=metrics,
                            state=encode_state(self.state) if include_state else b"")
