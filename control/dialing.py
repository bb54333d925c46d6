"""The dial on the control loop: resizes from ask to verdict (the pure steps are control/dial.py).

    resize      validate, refuse (recorded) or plan; the evictions requested like anyone's moves
    _rebind     once they are acked: RebindRequested recorded; ResizePool leaves after its commit
    on_rebound  the worker's PoolRebound: stamps, PoolResized, the control's readers, the verdict
    watch       a rebind with no answer by its deadline (or whose worker went) is torn

A group's pool (``serve --tp``) is resized as one: asked of its leader, planned on the leader's
books (the block ids are the same on every rank, so one ``num_slots`` for every rank, each rank's
bytes being its shard's), its evictions are group moves, then a RebindRequested per rank (its own
readers, id ``<rid>.r<rank>``), ResizePool to every rank, and the verdict all or torn
(``dial.verdicts``): committed on every rank only when every rank stamped every reader.

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
    """A resize in progress on one worker, or on every rank of a group (``ranks``, leader first)."""

    __slots__ = ("rid", "worker", "ranks", "origin", "plan", "waiter", "reqs", "answers", "deadline_ns", "phase",
                 "epochs")

    def __init__(self, rid: str, worker: int, origin: str, plan: dial.ResizePlan, waiter: moves.AskWaiter,
                 ranks: list[int] | None = None):
        self.rid, self.worker, self.origin, self.plan, self.waiter = rid, worker, origin, plan, waiter
        self.ranks = ranks or [worker]
        self.reqs: dict[int, ev.RebindRequested] = {}            # rank's worker -> its rebind
        self.answers: dict[str, set[str] | str] = {}             # rebind id -> stamped readers | error
        self.deadline_ns = 0          # wall clock: the rebind's answer is due by then
        self.phase = "moving"         # moving (evictions) | draining (others' moves end) | rebinding
        self.epochs: dict[int, int] = {}     # the worker incarnation each ResizePool went to


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
        # the ranks of the tensor-parallel group of a worker, leader first ([]: alone; set for serve --tp)
        self.ranks_of: Callable[[int], list[int]] = lambda worker: []
        # the context floor of a serving worker's pool (None: it serves no model; set by the serving path)
        self.context_of: Callable[[int], dial.ContextFloor | None] = lambda worker: None

    # ------------------------------------------------------------------ readers and holds
    def add_reader(self, name: str, fn: Reader) -> None:
        """A reader of every device pool in the control process, stamped on each rebind."""
        self.readers[name] = fn

    def holds(self, worker: int) -> tuple[str, str] | None:
        """(code, reason) when ``worker``'s device pool takes no new request and no move now: a
        resize of it is moving blocks out, waiting for moves to end, or rebinding; or it is torn.
        A rank of a group is held when any rank's pool is (the ranks hold shards of one pool)."""
        run = self.runs.get(worker)
        if run is not None and run.phase != "rebinding":
            return ("pool_rebinding", f"the device pool of worker {worker} is being resized by {run.rid} "
                                      f"({'moving blocks out' if run.phase == 'moving' else 'waiting for its moves to end'} first)")
        for w in self.ranks_of(worker) or [worker]:
            why = dial.closed(self.state, w)
            if why is not None:
                return why
        return None

    def refuse_moves(self, proposals) -> Refusal | None:
        """The refusal of moves into or out of a held or closed device pool (``dial.refuse_moves``)."""
        return dial.refuse_moves(self.state, proposals, self.holds)

    # ------------------------------------------------------------------ asks
    def ask(self, msg: AskResize, origin: str, waiter: moves.AskWaiter) -> None:
        """The operator's ask; raises moves.InvalidAsk for one that names nothing resizable."""
        self.resize(msg.worker, msg.tier, msg.bytes, origin, waiter, causation=msg.ask_id or None)

    def resize(self, worker: int, tier: str, nbytes: int, origin: str, waiter: moves.AskWaiter,
               causation: str | None = None, sleeping: bool = False) -> None:
        """Resize ``worker``'s ``tier`` pool to ``nbytes``; ``waiter`` is answered after commit with
        every event recorded for it (a refusal: its MoveRefused). The entry point for a reclaim.
        ``sleeping``: the shrink of a sleep (control/flipping.py), the one resize that may end below
        the pool's context floor: the model leaves the device with it, and its wake grows it back."""
        try:
            dial.validate(self.state, worker, tier, nbytes)
        except dial.InvalidResize as e:
            raise moves.InvalidAsk(str(e)) from None
        ranks = self.ranks_of(worker) or [worker]
        if ranks[0] != worker:      # a rank's own view never decides: the leader's plan is the group's
            raise moves.InvalidAsk(f"worker {worker} is a follower rank of a tensor-parallel group: resize its "
                                   f"leader, worker {ranks[0]}, and every rank's pool is resized with it")
        for w in ranks:
            if w != worker:
                self._validate_rank(w)
            if w not in self.workers.by_worker:
                raise moves.InvalidAsk(f"worker {w} is not linked to this control process")
        running = next((self.runs[w] for w in ranks if w in self.runs), None)
        if running is not None:
            to_bytes = nbytes // self.state.workers[worker].block_bytes * self.state.workers[worker].block_bytes
            self._refuse(dial.busy_refusal(self.state, worker, to_bytes, f"resize {running.rid}"), origin,
                         waiter, causation)
            return
        for w in ranks:
            pending = dial.open_rebind(self.state, w)
            if pending is not None and pending.status == "requested":   # a rebind this loop does not run
                self._refuse(dial.busy_refusal(self.state, w, nbytes, f"rebind {pending.rebind_id}"), origin,
                             waiter, causation)
                return
        in_use = self.blocks_in_use()
        context = None if sleeping else self.context_of(worker)
        got = dial.plan(self.state, self.recency, origin, worker, tier, nbytes, in_use.get(worker, set()), context)
        for w in ranks[1:]:     # the leader's plan is the group's; a rank whose own floor it breaks refuses it
            if isinstance(got, Refusal):
                break
            slots = got.num_slots * self.state.workers[w].block_bytes
            mine = dial.plan(self.state, self.recency, origin, w, tier, slots, in_use.get(w, set()))
            got = mine if isinstance(mine, Refusal) else got
        if isinstance(got, Refusal):
            self._refuse(got, origin, waiter, causation)
            return
        evict = self.dispatcher.expand(got.evict) if len(ranks) > 1 else got.evict   # each rank's shard
        for p in evict:
            moves.validate(self.state, p, self.dispatcher.busy.by_worker)
        refusal = moves.fund(self.state, evict, self.dispatcher.reserved_bytes())
        if refusal is not None:     # host cannot take what must leave: refused whole, nothing moves
            pages = sum(len(p.blocks) for p in got.evict)
            self._refuse(msgspec.structs.replace(refusal, reason=(
                f"resize of the device pool of worker {worker} to {got.to_bytes}: host cannot take the {pages} "
                f"pages that must leave the device: {refusal.reason}")), origin, waiter, causation)
            return
        self._num += 1
        run = Run(dial.rebind_id(self.epoch, self._num), worker, origin, got, waiter, ranks)
        for w in ranks:
            self.runs[w] = run
        waiter.open.add(run.rid)
        log.info("resize_started", rebind_id=run.rid, worker=worker, ranks=ranks, from_bytes=got.from_bytes,
                 to_bytes=got.to_bytes, evictions=sum(len(p.blocks) for p in got.evict))
        if evict:
            moved = moves.AskWaiter(run.rid, lambda events, _m, _e, _d, run=run: self._moved(run, events))
            for p in evict:
                self.dispatcher.request(p, moved)
        else:
            self._rebind(run)

    def _validate_rank(self, worker: int) -> None:
        """A follower rank can be resized with its leader (serving, a block size)."""
        ws = self.state.workers.get(worker)
        if ws is None or not ws.alive or ws.block_bytes <= 0:
            raise moves.InvalidAsk(f"rank worker {worker} of the group is not serving: a group's pool is resized "
                                   "on every rank or not at all")

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
        if any(mv.worker in run.ranks for mv in self.state.inflight.values()):
            run.phase = "draining"          # watch() tries again as they end
            return
        links = {w: self.workers.by_worker.get(w) for w in run.ranks}
        if any(link is None for link in links.values()):
            log.warning("resize_stopped", rebind_id=run.rid, worker=run.worker, why="worker not linked")
            self._finish(run)
            return
        run.phase = "rebinding"
        nbytes = abs(run.plan.from_bytes - run.plan.to_bytes)
        run.deadline_ns = time.time_ns() + int((self.deadline_s + nbytes / self.deadline_bytes_per_s) * S)
        cmds, seq = [], 0
        for k, (w, link) in enumerate(links.items()):      # one rebind per rank: each its own readers
            rid = dial.rank_rebind_id(run.rid, k, len(run.ranks))
            req = dial.requested(self.state, rid, w, link.pool_gen, list(self.readers), link.readers)
            run.reqs[w], run.epochs[w] = req, link.epoch
            seq = self.recorder.record(req, causation=run.origin)
            run.waiter.events.append((seq, req))
            cmds.append((w, ResizePool(rebind_id=rid, tier=dial.DEVICE, num_slots=run.plan.num_slots,
                                       to_gen=req.to_gen, deadline_ns=run.deadline_ns)))
        # write-ahead: the commands leave once every rank's RebindRequested is committed
        gate = moves.AskWaiter(run.rid, lambda *_a, run=run, cmds=cmds: self._send(run, cmds))
        gate.events.append((seq, req))
        self.answers.after_commit(gate)

    def _send(self, run: Run, cmds: list[tuple[int, ResizePool]]) -> None:
        if self.runs.get(run.worker) is not run:
            return
        for w, cmd in cmds:
            link = self.workers.by_worker.get(w)
            if link is None or not self.workers.send(link, cmd):
                log.warning("resize_not_sent", rebind_id=cmd.rebind_id, worker=w)   # torn at the deadline
            else:
                log.info("resize_sent", rebind_id=cmd.rebind_id, worker=w, num_slots=cmd.num_slots, to_gen=cmd.to_gen)

    def on_rebound(self, link: WorkerLink, msg: PoolRebound) -> None:
        run = self.runs.get(link.worker)
        if not msg.error:
            link.pool_gen = msg.to_gen    # what the worker's pool carries now, whatever we recorded
        req = run.reqs.get(link.worker) if run is not None else None
        if req is None or req.rebind_id != msg.rebind_id or req.rebind_id in run.answers:
            log.warning("rebound_unexpected", worker=link.worker, rebind_id=msg.rebind_id, error=msg.error)
            return
        recorded = [(self.recorder.record(e, causation=run.rid), e) for e in dial.worker_answer(req, msg)]
        stamped = {e.reader for _, e in recorded if type(e) is ev.ReaderStamped}
        if not msg.error:
            for name, reader in self.readers.items():     # after PoolResized is folded: they see it
                if name in req.readers and reader(self.state, req.worker, req.to_gen, msg.to_bytes) == req.to_gen:
                    e = ev.ReaderStamped(rebind_id=req.rebind_id, reader=name, gen=req.to_gen)
                    recorded.append((self.recorder.record(e, causation=run.rid), e))
                    stamped.add(name)
        run.answers[req.rebind_id] = msg.error or stamped
        run.waiter.events.extend(recorded)
        log.info("resize_answered", rebind_id=req.rebind_id, worker=link.worker, error=msg.error or None,
                 measured_freed_bytes=msg.measured_freed_bytes)
        if len(run.answers) == len(run.reqs):      # every rank answered: the verdict of all of them
            self._verdicts(run, run.rid)

    def _verdicts(self, run: Run, causation: str) -> None:
        """Record the verdicts of every rank's rebind (``dial.verdicts``: all or torn), then finish."""
        for e in dial.verdicts(list(run.reqs.values()), run.answers):
            run.waiter.events.append((self.recorder.record(e, causation=causation), e))
        log.info("resize_decided", rebind_id=run.rid, ranks=run.ranks, answered=sorted(run.answers))
        self._finish(run)

    def watch(self, now_ns: int | None = None) -> None:
        """Tear the rebinds with no answer by their deadline, or whose worker went."""
        now = time.time_ns() if now_ns is None else now_ns
        for run in {id(r): r for r in self.runs.values()}.values():     # a group's run is under every rank
            if run.phase == "draining":
                if not any(mv.worker in run.ranks for mv in self.state.inflight.values()):
                    self._rebind(run)
                continue
            if run.phase != "rebinding":
                continue
            gone = [w for w, req in run.reqs.items() if req.rebind_id not in run.answers and not self._here(run, w)]
            if now < run.deadline_ns and not gone:
                continue
            log.error("rebind_torn", rebind_id=run.rid, workers=run.ranks, gone=gone,
                      why="worker gone" if gone else "deadline")
            self._verdicts(run, run.rid)      # a rank with no answer is behind on every reader
        self.problems = tuple(dial.torn_pools(self.state))

    def stop(self, reason: str) -> None:
        """The control stops: a rebind still unanswered is torn (its readers unknown), and every
        resize's asker hears what was recorded for it."""
        for run in {id(r): r for r in self.runs.values()}.values():
            if run.phase == "rebinding":     # a rank still unanswered: torn, its readers unknown
                self._verdicts(run, f"control:stop: {reason}")
            else:
                self._finish(run)

    def _here(self, run: Run, worker: int) -> bool:
        """``worker`` is still the incarnation ``run``'s ResizePool went to."""
        ws = self.state.workers.get(worker)
        link = self.workers.by_worker.get(worker)
        return ws is not None and ws.alive and link is not None and link.epoch == run.epochs.get(worker)

    def _finish(self, run: Run) -> None:
        for w in run.ranks:
            if self.runs.get(w) is run:
                del self.runs[w]
        run.waiter.open.discard(run.rid)
        if run.waiter.done:
            self.answers.after_commit(run.waiter)
        self.problems = tuple(dial.torn_pools(self.state))
