"""The dial on the control loop: resizes from ask to verdict (the pure steps are control/dial.py).

    resize      validate, refuse (recorded) or plan; the evictions requested like anyone's moves
    _rebind     once they are acked: RebindRequested recorded; ResizePool leaves after its commit
    on_rebound  the worker's PoolRebound: stamps, PoolResized, the control's readers, the verdict
    watch       a rebind with no answer by its deadline (or whose worker went) is torn

A resize is asked with an ``AskWaiter`` (the operator's ask, or a reclaim's own): it is answered,
after commit, with every event recorded for the resize, in seq order. One resize per worker at a
time; from its start (the evictions included) the worker's pool takes no new request (``holds``).

Control readers (``add_reader``): name -> fn(state, worker, to_gen, to_bytes) -> the gen it
carries now; the serving scheduler is one (it is at to_gen once it sees the new capacity).
Loop thread only.
"""
from __future__ import annotations

import time
from typing import Callable

import msgspec
import structlog

from residency.events import catalog as ev
from residency.events.asks import AskResize
from residency.events.commands import PoolRebound, ResizePool
from residency.control import dial, moves
from residency.control.answers import Answers
from residency.control.budget import Refusal
from residency.control.lifecycle import MoveDispatcher
from residency.control.links import WorkerLink, WorkerRegistry
from residency.control.policy.recency import Recency
from residency.control.recorder import Recorder
from residency.control.state import State

log = structlog.get_logger("control.dial")
S = 1_000_000_000
Reader = Callable[[State, int, int, int], int]


class Run:
    """A resize in progress on one worker."""

    __slots__ = ("rid", "worker", "origin", "plan", "waiter", "req", "deadline_ns", "phase", "epoch")

    def __init__(self, rid: str, worker: int, origin: str, plan: dial.ResizePlan, waiter: moves.AskWaiter):
        self.rid, self.worker, self.origin, self.plan, self.waiter = rid, worker, origin, plan, waiter
        self.req: ev.RebindRequested | None = None
        self.deadline_ns = 0          # wall clock: the rebind's answer is due by then
        self.phase = "moving"         # moving (evictions) | draining (others' moves end) | rebinding
        self.epoch = -1               # the worker incarnation the ResizePool went to


class Dial:
    def __init__(self, state: State, recency: Recency, epoch: int, recorder: Recorder, workers: WorkerRegistry,
                 dispatcher: MoveDispatcher, answers: Answers, blocks_in_use: Callable[[], dict[int, set[int]]],
                 readers: dict[str, Reader] | None = None, deadline_s: float = 30.0,
                 deadline_bytes_per_s: float = 1.0e9):
        self.state = state
        self.recency = recency
        self.epoch = epoch
        self.recorder = recorder
        self.workers = workers
        self.dispatcher = dispatcher
        self.answers = answers
        self.blocks_in_use = blocks_in_use
        self.deadline_s = deadline_s
        self.deadline_bytes_per_s = deadline_bytes_per_s
        self.readers: dict[str, Reader] = dict(readers or {})
        self.runs: dict[int, Run] = {}
        self._num = 0
        # replaced whole on the loop thread; read by health() from any thread
        self.problems: tuple[str, ...] = tuple(dial.torn_pools(state))
        # whether a worker is a rank of a tensor-parallel group (set by the control for serve --tp)
        self.in_group: Callable[[int], bool] = lambda worker: False

    # ------------------------------------------------------------------ readers and holds
    def add_reader(self, name: str, fn: Reader) -> None:
        """A reader of every device pool in the control process, stamped on each rebind."""
        self.readers[name] = fn

    def holds(self, worker: int) -> tuple[str, str] | None:
        """(code, reason) when ``worker``'s device pool takes no new request and no move now: a
        resize of it is moving blocks out, waiting for moves to end, or rebinding; or it is torn."""
        run = self.runs.get(worker)
        if run is not None and run.phase != "rebinding":
            return ("pool_rebinding", f"the device pool of worker {worker} is being resized by {run.rid} "
                                      f"({'moving blocks out' if run.phase == 'moving' else 'waiting for its moves to end'} first)")
        return dial.closed(self.state, worker)

    def refuse_moves(self, proposals) -> Refusal | None:
        """The refusal of moves into or out of a held or closed device pool (``dial.refuse_moves``)."""
        return dial.refuse_moves(self.state, proposals, self.holds)

    # ------------------------------------------------------------------ asks
    def ask(self, msg: AskResize, origin: str, waiter: moves.AskWaiter) -> None:
        """The operator's ask; raises moves.InvalidAsk for one that names nothing resizable."""
        self.resize(msg.worker, msg.tier, msg.bytes, origin, waiter, causation=msg.ask_id or None)

    def resize(self, worker: int, tier: str, nbytes: int, origin: str, waiter: moves.AskWaiter,
               causation: str | None = None) -> None:
        """Resize ``worker``'s ``tier`` pool to ``nbytes``; ``waiter`` is answered after commit with
        every event recorded for it (a refusal: its MoveRefused). The entry point for a reclaim."""
        try:
            dial.validate(self.state, worker, tier, nbytes)
        except dial.InvalidResize as e:
            raise moves.InvalidAsk(str(e)) from None
        if self.in_group(worker):
            # NOTE: a group's ranks must hold pools of one size (the same block ids on every rank);
            # a resize that rebinds every rank together is not built, so none is started
            raise moves.InvalidAsk(f"worker {worker} is a rank of a tensor-parallel group: resizing a group's "
                                   "pools (every rank at once) is not supported")
        if worker not in self.workers.by_worker:
            raise moves.InvalidAsk(f"worker {worker} is not linked to this control process")
        running = self.runs.get(worker)
        if running is not None:
            to_bytes = nbytes // self.state.workers[worker].block_bytes * self.state.workers[worker].block_bytes
            self._refuse(dial.busy_refusal(self.state, worker, to_bytes, f"resize {running.rid}"), origin,
                         waiter, causation)
            return
        pending = dial.open_rebind(self.state, worker)
        if pending is not None and pending.status == "requested":   # a rebind this loop does not run
            self._refuse(dial.busy_refusal(self.state, worker, nbytes, f"rebind {pending.rebind_id}"), origin,
                         waiter, causation)
            return
        got = dial.plan(self.state, self.recency, origin, worker, tier, nbytes,
                        self.blocks_in_use().get(worker, set()))
        if isinstance(got, Refusal):
            self._refuse(got, origin, waiter, causation)
            return
        for p in got.evict:
            moves.validate(self.state, p, self.dispatcher.busy.by_worker)
        refusal = moves.fund(self.state, got.evict, self.dispatcher.reserved_bytes())
        if refusal is not None:     # host cannot take what must leave: refused whole, nothing moves
            pages = sum(len(p.blocks) for p in got.evict)
            self._refuse(msgspec.structs.replace(refusal, reason=(
                f"resize of the device pool of worker {worker} to {got.to_bytes}: host cannot take the {pages} "
                f"pages that must leave the device: {refusal.reason}")), origin, waiter, causation)
            return
        self._num += 1
        run = Run(dial.rebind_id(self.epoch, self._num), worker, origin, got, waiter)
        self.runs[worker] = run
        waiter.open.add(run.rid)
        log.info("resize_started", rebind_id=run.rid, worker=worker, from_bytes=got.from_bytes,
                 to_bytes=got.to_bytes, evictions=sum(len(p.blocks) for p in got.evict))
        if got.evict:
            moved = moves.AskWaiter(run.rid, lambda events, _m, _e, _d, run=run: self._moved(run, events))
            for p in got.evict:
                self.dispatcher.request(p, moved)
        else:
            self._rebind(run)

    def _refuse(self, refusal: Refusal, origin: str, waiter: moves.AskWaiter, causation: str | None) -> None:
        e = refusal.event(origin)
        log.info("resize_refused", worker=refusal.worker, asked_bytes=refusal.asked_bytes,
                 floor_bytes=refusal.floor_bytes, reason=refusal.reason)
        waiter.events.append((self.recorder.record(e, causation=causation), e))
        self.answers.after_commit(waiter)

    # ------------------------------------------------------------------ moving blocks out
    def _moved(self, run: Run, events: list) -> None:
        run.waiter.events.extend(events)
        if self.runs.get(run.worker) is not run:
            return
        bad = [e for _, e in events if type(e) not in (ev.MoveAcked, ev.CopiesReleased)]
        if bad:
            log.warning("resize_stopped", rebind_id=run.rid, worker=run.worker,
                        outcomes=[type(e).__name__ for e in bad])
            self._finish(run)
            return
        self._rebind(run)

    # ------------------------------------------------------------------ the rebind
    def _rebind(self, run: Run) -> None:
        # NOTE: the worker refuses a resize while any move of its runs (a slot may be mid-copy):
        # the pool is held from the start, so only moves asked before it can still be running
        if any(mv.worker == run.worker for mv in self.state.inflight.values()):
            run.phase = "draining"          # watch() tries again as they end
            return
        link = self.workers.by_worker.get(run.worker)
        if link is None:
            log.warning("resize_stopped", rebind_id=run.rid, worker=run.worker, why="worker not linked")
            self._finish(run)
            return
        req = dial.requested(self.state, run.rid, run.worker, link.pool_gen, list(self.readers), link.readers)
        run.req, run.phase, run.epoch = req, "rebinding", link.epoch
        nbytes = abs(run.plan.from_bytes - run.plan.to_bytes)
        run.deadline_ns = time.time_ns() + int((self.deadline_s + nbytes / self.deadline_bytes_per_s) * S)
        seq = self.recorder.record(req, causation=run.origin)
        run.waiter.events.append((seq, req))
        cmd = ResizePool(rebind_id=run.rid, tier=dial.DEVICE, num_slots=run.plan.num_slots, to_gen=req.to_gen,
                         deadline_ns=run.deadline_ns)
        # write-ahead: the command leaves once RebindRequested is committed
        gate = moves.AskWaiter(run.rid, lambda *_a, run=run, cmd=cmd: self._send(run, cmd))
        gate.events.append((seq, req))
        self.answers.after_commit(gate)

    def _send(self, run: Run, cmd: ResizePool) -> None:
        if self.runs.get(run.worker) is not run:
            return
        link = self.workers.by_worker.get(run.worker)
        if link is None or not self.workers.send(link, cmd):
            log.warning("resize_not_sent", rebind_id=run.rid, worker=run.worker)   # torn at the deadline
        else:
            log.info("resize_sent", rebind_id=run.rid, worker=run.worker, num_slots=cmd.num_slots, to_gen=cmd.to_gen)

    def on_rebound(self, link: WorkerLink, msg: PoolRebound) -> None:
        run = self.runs.get(link.worker)
        if not msg.error:
            link.pool_gen = msg.to_gen    # what the worker's pool carries now, whatever we recorded
        if run is None or run.req is None or run.rid != msg.rebind_id:
            log.warning("rebound_unexpected", worker=link.worker, rebind_id=msg.rebind_id, error=msg.error)
            return
        req = run.req
        recorded = [(self.recorder.record(e, causation=run.rid), e) for e in dial.worker_answer(req, msg)]
        stamped = {e.reader for _, e in recorded if type(e) is ev.ReaderStamped}
        if not msg.error:
            for name, reader in self.readers.items():     # after PoolResized is folded: they see it
                if name in req.readers and reader(self.state, req.worker, req.to_gen, msg.to_bytes) == req.to_gen:
                    e = ev.ReaderStamped(rebind_id=req.rebind_id, reader=name, gen=req.to_gen)
                    recorded.append((self.recorder.record(e, causation=run.rid), e))
                    stamped.add(name)
            e = dial.verdict(req, stamped)
            recorded.append((self.recorder.record(e, causation=run.rid), e))
        run.waiter.events.extend(recorded)
        log.info("resize_answered", rebind_id=run.rid, worker=run.worker, error=msg.error or None,
                 verdict=type(recorded[-1][1]).__name__, measured_freed_bytes=msg.measured_freed_bytes)
        self._finish(run)

    def watch(self, now_ns: int | None = None) -> None:
        """Tear the rebinds with no answer by their deadline, or whose worker went."""
        now = time.time_ns() if now_ns is None else now_ns
        for run in list(self.runs.values()):
            if run.phase == "draining":
                if not any(mv.worker == run.worker for mv in self.state.inflight.values()):
                    self._rebind(run)
                continue
            if run.phase != "rebinding":
                continue
            ws = self.state.workers.get(run.worker)
            link = self.workers.by_worker.get(run.worker)
            gone = ws is None or not ws.alive or link is None or link.epoch != run.epoch
            if now < run.deadline_ns and not gone:
                continue
            e = dial.unanswered(run.req)
            log.error("rebind_torn", rebind_id=run.rid, worker=run.worker, why="worker gone" if gone else "deadline")
            run.waiter.events.append((self.recorder.record(e, causation=run.rid), e))
            self._finish(run)
        self.problems = tuple(dial.torn_pools(self.state))

    def stop(self, reason: str) -> None:
        """The control stops: a rebind still unanswered is torn (its readers unknown), and every
        resize's asker hears what was recorded for it."""
        for run in list(self.runs.values()):
            if run.phase == "rebinding":
                e = dial.unanswered(run.req)
                run.waiter.events.append((self.recorder.record(e, causation=f"control:stop: {reason}"), e))
            self._finish(run)

    def _finish(self, run: Run) -> None:
        if self.runs.get(run.worker) is run:
            del self.runs[run.worker]
        run.waiter.open.discard(run.rid)
        if run.waiter.done:
            self.answers.after_commit(run.waiter)
        self.problems = tuple(dial.torn_pools(self.state))
