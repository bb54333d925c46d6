"""The move dispatcher: a move's life on the control loop (the pure steps are control/moves.py).

    request    MoveRequested folded and buffered; the command waits for its commit
    dispatch   committed: now (and only now) the command leaves
    on_outcome / on_released / on_report (reconciled after a restart)
    settle     the terminal (or late) event and its follow-ups; the asker is answered after commit
    watch_deadlines, requery   the watchdog's MoveStranded, and querying again for late acks
    run_policies               the policies' proposals, funded or refused like anyone's asks

Loop thread only.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import msgspec
import structlog

from residency.events import catalog as ev
from residency.events.commands import BlocksReleased, CommandAhead, MovesReport, MoveTimed
from residency.control import budget, dial, moves, recovery, watchdog
from residency.control.answers import Answers
from residency.control.awake_poll import AwakePoll
from residency.control.config import ControlConfig
from residency.control.keep_awake import AwakeWhileMoving
from residency.control.links import WorkerLink, WorkerRegistry
from residency.control.policy import RefusalMemo, plan
from residency.control.policy.recency import Recency
from residency.control.probes import ControlFaults, MoveTraces
from residency.control.recorder import Recorder
from residency.control.state import State

log = structlog.get_logger("control.lifecycle")
S = 1_000_000_000


class MoveDispatcher:
    """Moves from request to outcome (loop thread only)."""

    def __init__(self, cfg: ControlConfig, state: State, recency: Recency, epoch: int, recorder: Recorder,
                 book: moves.MoveBook, busy: moves.BusyIndex, workers: WorkerRegistry, answers: Answers,
                 awake: AwakePoll, keep_awake: AwakeWhileMoving | None, traces: MoveTraces, faults: ControlFaults,
                 metrics: collections.Counter, blocks_in_use: Callable[[], dict[int, set[int]]]):
        self.cfg = cfg
        self.state = state
        self.recency = recency
        self.epoch = epoch
        self.recorder = recorder
        self.book = book
        self.busy = busy
        self.workers = workers
        self.answers = answers
        self.awake = awake
        self.keep_awake = keep_awake
        self.traces = traces
        self.faults = faults
        self.metrics = metrics
        self.blocks_in_use = blocks_in_use
        # (code, reason) of a device pool the dial holds closed (control/dialing.py Dial.holds);
        # None: only what the state shows (a rebind requested or torn) closes one
        self.holds: Callable[[int], tuple[str, str] | None] | None = None
        # stranded moves their worker says it never received: it tombstones them, so they will never
        # land and hold neither blocks nor room. Not recorded: the worker that answers may be a new
        # incarnation, which cannot speak for the command its lost predecessor had (a rejection or
        # failure, which only the worker that had the command can send, is: MoveLateFailed).
        self.answered_stranded: set[str] = set()
        self.memo = RefusalMemo()
        # a group's moves (control/groups.py): an ask's proposals for every rank, and a policy's
        # proposal as the group's moves ([] when it names a follower, whose own view never decides)
        self.expand: Callable[[list], list] = lambda proposals: proposals
        self.for_policy: Callable[[object], list] = lambda proposal: [proposal]
        self._num_moves = 0
        self._unsent: dict[int, list[ev.MoveRequested]] = {}     # committed, but the worker was not linked
        self._next_park = time.monotonic_ns()

    # ------------------------------------------------------------------ request and dispatch
    def request(self, proposal, waiter: moves.AskWaiter | None, asked_ns: int = 0) -> str:
        self._num_moves += 1
        mid = moves.move_id(self.epoch, self._num_moves)
        req = moves.requested(self.state, proposal, mid, time.time_ns(), self.cfg.moves)
        if 0 < self.cfg.command_ahead_min_bytes <= req.bytes_planned and not proposal.is_release:
            self._command_ahead(req)
        if self.keep_awake is not None and not proposal.is_release:
            self.keep_awake.requested(mid, req.bytes_planned)     # after the hint: its wake-ups cost little
        seq = self.recorder.record(req, correlation=proposal.session, causation=proposal.origin)
        self.book.requested(seq, req, waiter)
        self.busy.add(proposal.worker, proposal.blocks)
        if self.traces.keep:
            self.traces.mark(mid, "asked", asked_ns)
            self.traces.mark(mid, "requested")
        return mid

    def wake_lane(self, worker: int, num_blocks: int) -> None:
        """An ask for a big copy has come (at least ``command_ahead_min_bytes``): before resolving
        it, a CommandAhead without a command (move_id "") wakes the worker's lane, so that it
        polls awake when the one with the command follows (a long-idle thread's wake-up then
        overlaps the resolve instead of following it; bench/zmq_wake.py).

        Not while the keep-awake spinners spin: a woken thread then runs at once, and the wake-up
        would only be a send more on the ask's path (bench/RESULTS.md, control)."""
        if self.keep_awake is not None and self.keep_awake.awake:
            return
        ws = self.state.workers.get(worker)
        link = self.workers.by_worker.get(worker)
        if (ws is None or link is None or link.lane is None or not link.lane_up
                or not 0 < self.cfg.command_ahead_min_bytes <= num_blocks * ws.block_bytes):
            return
        self.metrics["lanes_woken"] += 1
        self.workers.send(link, CommandAhead(move_id="", within_us=self.cfg.command_ahead_us))

    def _command_ahead(self, req: ev.MoveRequested) -> None:
        """Tell the worker's lane that this move's command follows its commit, so its thread is
        awake to read it; for a device <-> host copy the hint carries the command, and the worker
        may begin the copies meanwhile. Write-ahead holds for everything anyone can see: the
        worker publishes, frees and answers nothing before the command itself, which leaves only
        after the commit (``dispatch``); a hint whose command never comes is undone there
        (``WorkerCore.drop_ahead``)."""
        link = self.workers.by_worker.get(req.worker)
        if link is not None and link.lane is not None and link.lane_up:
            self.metrics["commands_ahead"] += 1
            early = {req.src, req.dst} == {"device", "host"}
            if early:
                self.metrics["commands_sent_ahead"] += 1
            hint = CommandAhead(move_id=req.move_id, within_us=self.cfg.command_ahead_us,
                                command=moves.command_for(req) if early else None)
            if self.traces.keep:   # marked before it leaves: the worker may begin before send returns
                self.traces.mark(req.move_id, "ahead")
            self.workers.send(link, hint)

    def dispatch(self, req: ev.MoveRequested) -> None:
        """The MoveRequested is committed: now (and only now) the command may leave."""
        if req.move_id not in self.state.inflight:
            self.book.undispatched.discard(req.move_id)
            return   # settled meanwhile (worker lost, deadline)
        link = self.workers.by_worker.get(req.worker)
        if link is None:   # not back yet: sent when it is, or settled by the watchdog / its loss
            self._unsent.setdefault(req.worker, []).append(req)
            return
        self.faults.hit("crash_after_requested")
        self.traces.mark(req.move_id, "committed")
        if self.workers.send(link, moves.command_for(req)):
            self.traces.mark(req.move_id, "sent")
            self.book.sent(req.move_id, time.monotonic_ns())
            # NOTE: not write-ahead: the command has left already, and nothing waits for this
            # row's commit (it rides the next group commit, before the move's outcome can)
            self.recorder.record(ev.MoveDispatched(move_id=req.move_id, worker=req.worker), causation=req.move_id)
            self.faults.hit("crash_after_dispatch", delay_s=0.05)

    def worker_joined(self, worker: int) -> None:
        """Send the commands that committed while ``worker`` was not linked."""
        for req in self._unsent.pop(worker, []):
            self.dispatch(req)

    # ------------------------------------------------------------------ outcomes
    def on_outcome(self, link: WorkerLink, msg) -> None:
        self.faults.hit("crash_before_ack_append")
        self.awake.outcome_came(msg.move_id)
        if self.traces.keep:
            self.traces.mark(msg.move_id, "received", self.workers.last_recv_ns)
            self.traces.mark(msg.move_id, "decoded")
        verdict, event = moves.classify(self.state, link.worker, msg)
        self.metrics[f"outcome_{verdict}"] += 1
        if event is None:
            log.info("outcome_not_recorded", verdict=verdict, move_id=msg.move_id, worker=link.worker,
                     type=type(msg).__name__, why=getattr(msg, "reason", None) or getattr(msg, "error", None))
            return
        self.settle(msg.move_id, event)

    def on_timed(self, link: WorkerLink, msg: MoveTimed) -> None:
        if self.traces.keep and msg.move_id in self.traces.by_move:
            for phase in ("received_ns", "queued_ns", "engine_start_ns", "engine_end_ns", "sent_ns"):
                self.traces.mark(msg.move_id, "w_" + phase.removesuffix("_ns"), getattr(msg, phase))
            if msg.ahead_ns:
                self.traces.mark(msg.move_id, "w_ahead", msg.ahead_ns)

    def on_released(self, link: WorkerLink, msg: BlocksReleased) -> None:
        self.on_outcome(link, moves.release_outcome(msg, time.time_ns()))

    def on_report(self, link: WorkerLink, msg: MovesReport) -> None:
        settled = recovery.reconcile(self.state, link.worker, msg, sorted(link.queried))
        for verdict, event in settled:
            self.metrics[f"reconciled_{verdict}"] += 1
            self.settle(event.move_id, event)
        for mid in msg.unknown:
            mv = self.state.stranded.get(mid)
            if mv is not None and mv.worker == link.worker:   # answered for: it will never run now
                self._stranded_answered(mid)
        link.queried.difference_update(msg.unknown)
        link.queried.difference_update(o.move_id for o in msg.outcomes)
        if settled:
            log.info("moves_reconciled", worker=link.worker, settled=len(settled), unknown=len(msg.unknown))

    def _stranded_answered(self, mid: str) -> None:
        mv = self.state.stranded.get(mid)
        if mv is not None and mid not in self.answered_stranded:
            self.answered_stranded.add(mid)
            self.busy.remove(mv.worker, mv.blocks)
            log.warning("stranded_move_never_landed", move_id=mid, worker=mv.worker, bytes_at_risk=mv.bytes_planned)

    def reserved_bytes(self) -> dict[tuple[int, str], int]:
        return budget.stranded_toward(self.state, self.answered_stranded)

    def settle(self, mid: str, event: ev.Event) -> None:
        """Record a move's terminal (or late) event, its session follow-ups, and tell its asker.

        The ack of a lone move (the only one in flight), when no commit of ours is in flight, takes
        the short way: its events are committed here and an asker off the loop's thread (an
        operator's socket, the API's or a bench's future) answered before they are folded (the fold
        of a 1024-block ack is most of the control's work on it). They are folded before this
        returns, so nothing the loop runs (the next message, a policy, a checkpoint, a ``call``, a
        loop-thread asker's callback) ever sees the state without them. With other moves in flight
        their acks come in bursts, and a commit (and a GIL yield) per ack would halve what the loop
        sustains: those acks are committed together at the end of the loop's iteration, as any
        event (bench/RESULTS.md, control: sustained).
        """
        mv = self.state.inflight.get(mid) or self.state.stranded.get(mid)
        if mv is None:
            return
        self.awake.forget(mid)
        short = type(event) is ev.MoveAcked and self.recorder.commits_inline and len(self.state.inflight) == 1
        recorded = [(self.recorder.record(e, correlation=mv.session, causation=mid, fold_later=short), e)
                    for e in moves.settle_events(mv, event, self.cfg.moves, self.state)]
        self.traces.mark(mid, "recorded")
        if type(event) not in (ev.MoveLateAcked, ev.MoveLateFailed):   # its asker heard the stranding
            waiter = self.book.settled(mid)
            if waiter is not None:
                waiter.events.extend(recorded)
                waiter.open.discard(mid)
                if waiter.done:
                    self.answers.after_commit(waiter)
        if short:
            self.recorder.flush()               # durable (inline commit) ...
            self.traces.mark(mid, "ack_committed")
            self.answers.send_off_loop(len(mv.blocks))   # ... then the answer to an asker off this thread ...
            self.recorder.fold_deferred()       # ... then the bookkeeping (and any loop-thread asker)
            self.traces.mark(mid, "folded")
        if type(event) is not ev.MoveStranded:
            self.busy.remove(mv.worker, mv.blocks)
        if self.keep_awake is not None:
            self.keep_awake.settled(mid)

    # ------------------------------------------------------------------ the watchdog and the policies
    def watch_deadlines(self) -> None:
        if not self.state.inflight:
            return
        now = time.time_ns() - int(self.cfg.deadline_grace_s * S)
        for e in watchdog.overdue(self.state, now, self.book.undispatched, self.workers.adopting):
            log.warning("move_overdue", move_id=e.move_id, worker=e.worker, outcome=type(e).__name__)
            self.settle(e.move_id, e)

    def requery(self) -> None:
        """Query workers about their stranded moves: a dropped ack comes back as MoveLateAcked."""
        stranded: dict[int, list[str]] = {}
        for mid, mv in self.state.stranded.items():
            if mid not in self.answered_stranded:
                stranded.setdefault(mv.worker, []).append(mid)
        for w, mids in stranded.items():
            link = self.workers.by_worker.get(w)
            if link is not None:
                self.workers.query(link, mids[:4096])

    def run_policies(self) -> None:
        now = time.time_ns()
        busy = self.busy.by_worker
        in_use = self.blocks_in_use()
        if in_use:
            busy = {w: busy.get(w, set()) | in_use.get(w, set()) for w in set(busy) | set(in_use)}
        cfg = self.cfg.policy
        mono = time.monotonic_ns()
        if cfg.park and mono < self._next_park:     # parking looks at every block: once a second is plenty
            cfg = msgspec.structs.replace(cfg, park=False)
        elif cfg.park:
            self._next_park = mono + S
        for proposal in plan(self.state, self.recency, now, cfg, self.memo, busy):
            group = self.for_policy(proposal)       # a group's: every rank's shard, funded together
            if not group or dial.refuse_moves(self.state, group, self.holds) is not None:
                continue        # a closed pool (rebinding, torn): the policies wait, unrecorded
            try:
                for p in group:
                    moves.validate(self.state, p, busy)
            except moves.InvalidAsk:
                continue
            refusal = moves.fund(self.state, group, self.reserved_bytes())
            if refusal is not None:
                self.memo.note(proposal, refusal.available_bytes, now)
                log.info("move_refused", origin=proposal.origin, worker=proposal.worker, tier=refusal.tier,
                         asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
                self.recorder.record(refusal.event(proposal.origin, proposal.session), correlation=proposal.session)
                continue
            for p in group:
                self.request(p, None)
