"""A move's life on the control loop (the pure steps are control/moves.py):

    _request   MoveRequested folded and buffered; the command waits for its commit
    _dispatch  committed: now (and only now) the command leaves
    _on_outcome / _on_released / _on_report (reconciled after a restart)
    _settle    the terminal (or late) event and its follow-ups; the asker is answered after commit
    _watch_deadlines, _requery   the watchdog's MoveStranded, and asking again for late acks
    _run_policies                the policies' asks, funded or refused like anyone's

``MoveLifecycle`` is a part of ``ControlProc`` (control/proc.py), run on its loop thread. It reads and
sets the loop's fields made by ``StartStop._recover``: ``state``, ``book``, ``busy``, ``memo``,
``answered_stranded``, ``_by_worker``, ``_unsent``, ``_commits_pending``, ``_adopting``, ``traces``.
"""
from __future__ import annotations

import time

import msgspec
import structlog

from residency.events import catalog as ev
from residency.events.commands import BlocksReleased, CommandAhead, MovesReport, MoveTimed
from residency.control import budget, moves, recovery, watchdog
from residency.control.links import WorkerLink
from residency.control.policy import plan

log = structlog.get_logger("control.lifecycle")
S = 1_000_000_000


class MoveLifecycle:
    """Moves from request to outcome (a part of ControlProc; loop thread only)."""

    def _request(self, proposal, waiter: moves.AskWaiter | None) -> str:
        self._num_moves += 1
        mid = moves.move_id(self.epoch, self._num_moves)
        req = moves.requested(self.state, proposal, mid, time.time_ns(), self.cfg.moves)
        if 0 < self.cfg.command_ahead_min_bytes <= req.bytes_planned and not proposal.is_release:
            self._command_ahead(req)
        if self._keep_awake is not None and not proposal.is_release:
            self._stay_awake(req.bytes_planned, mid)     # after the hint: its wake-ups cost ~0.05 ms
        seq = self._record(req, correlation=proposal.session, causation=proposal.origin)
        self.book.requested(seq, req, waiter)
        self.busy.add(proposal.worker, proposal.blocks)
        if self.traces.keep:
            self.traces.mark(mid, "asked", self._ask_ns)
            self.traces.mark(mid, "requested")
        return mid

    def _stay_awake(self, nbytes: int, mid: str) -> None:
        """Move ``mid`` of ``nbytes`` is requested: if big, keep the host's CPUs from halting
        (``cfg.keep_awake``) until it is settled, at most its bytes at 10 GB/s + 50 ms."""
        if nbytes >= self.cfg.keep_awake_min_bytes:
            self._awake_moves.add(mid)
            self._keep_awake.until(time.monotonic_ns() + int((nbytes / 10e9 + 0.05) * S))

    def _awake_done(self, mid: str) -> None:
        """``mid`` is settled: once no big move is left, the CPUs may halt after the linger (the
        next big move of a burst then finds them awake, and its ask is not slowed by waking them)."""
        self._awake_moves.discard(mid)
        if not self._awake_moves:
            self._keep_awake.end_at(time.monotonic_ns() + int(self.cfg.keep_awake_linger_s * S))

    def _host_kept_awake(self) -> bool:
        """The keep-awake spinners are spinning (a window open): a woken thread then runs at once,
        so an ask needs no lane wake-up ahead of its resolve, which would only be a send more on its
        path (H200, 2 GiB spill, three runs each way: control overhead p50 0.58-0.79 ms without
        it, 0.66-0.89 with it; bench/results/control-2026-12-04-h200-run65..67)."""
        ka = self._keep_awake
        return ka is not None and ka.awake_until > time.monotonic_ns()

    def _wake_lane(self, worker: int, num_blocks: int) -> None:
        """An ask for a big copy has come (at least ``command_ahead_min_bytes``): before resolving
        it, a CommandAhead without a command (move_id "") wakes the worker's lane, so that it
        polls awake when the one with the command follows (a long-idle thread's wake-up then
        overlaps the resolve instead of following it; bench/zmq_wake.py: 0.36 ms vs 0.14)."""
        ws = self.state.workers.get(worker)
        link = self._by_worker.get(worker)
        if (ws is None or link is None or link.lane is None or not link.lane_up
                or not 0 < self.cfg.command_ahead_min_bytes <= num_blocks * ws.block_bytes):
            return
        self.metrics["lanes_woken"] += 1
        self._send(link, CommandAhead(move_id="", within_us=self.cfg.command_ahead_us))

    def _command_ahead(self, req: ev.MoveRequested) -> None:
        """Tell the worker's lane that this move's command follows its commit, so its thread is
        awake to read it; with ``start_ahead`` (device <-> host) the hint carries the command, and
        the worker may begin the copies meanwhile. Write-ahead holds for everything anyone can
        see: the worker publishes, frees and answers nothing before the command itself, which
        leaves only after the commit (``_dispatch``); a hint whose command never comes is undone
        there (``WorkerCore.drop_ahead``)."""
        link = self._by_worker.get(req.worker)
        if link is not None and link.lane is not None and link.lane_up:
            self.metrics["commands_ahead"] += 1
            early = self.cfg.start_ahead and {req.src, req.dst} == {"device", "host"}
            if early:
                self.metrics["commands_sent_ahead"] += 1
            hint = CommandAhead(move_id=req.move_id, within_us=self.cfg.command_ahead_us,
                                command=moves.command_for(req) if early else None)
            if self.traces.keep:   # marked before it leaves: the worker may begin before _send returns
                self.traces.mark(req.move_id, "ahead")
            self._send(link, hint)

    def _dispatch(self, req: ev.MoveRequested) -> None:
        """The MoveRequested is committed: now (and only now) the command may leave."""
        if req.move_id not in self.state.inflight:
            self.book.undispatched.discard(req.move_id)
            return   # settled meanwhile (worker lost, deadline)
        link = self._by_worker.get(req.worker)
        if link is None:   # not back yet: sent when it is, or settled by the watchdog / its loss
            self._unsent.setdefault(req.worker, []).append(req)
            return
        self.faults.hit("crash_after_requested")
        self.traces.mark(req.move_id, "committed")
        if self._send(link, moves.command_for(req)):
            self.traces.mark(req.move_id, "sent")
            self.book.sent(req.move_id, time.monotonic_ns())
            self.faults.hit("crash_after_dispatch", delay_s=0.05)

    def _on_outcome(self, link: WorkerLink, msg) -> None:
        self.faults.hit("crash_before_ack_append")
        if self._awake:
            self._awake.pop(msg.move_id, None)
        if self.traces.keep:
            self.traces.mark(msg.move_id, "received", self._recv_ns)
            self.traces.mark(msg.move_id, "decoded")
        verdict, event = moves.classify(self.state, link.worker, msg)
        self.metrics[f"outcome_{verdict}"] += 1
        if verdict == moves.LATE_FAILURE:
            self._stranded_answered(msg.move_id)
        if event is None:
            log.info("outcome_not_recorded", verdict=verdict, move_id=msg.move_id, worker=link.worker,
                     type=type(msg).__name__, why=getattr(msg, "reason", None) or getattr(msg, "error", None))
            return
        self._settle(msg.move_id, event)

    def _on_timed(self, link: WorkerLink, msg: MoveTimed) -> None:
        if self.traces.keep and msg.move_id in self.traces.by_move:
            for phase in ("received_ns", "queued_ns", "engine_start_ns", "engine_end_ns", "sent_ns"):
                self.traces.mark(msg.move_id, "w_" + phase.removesuffix("_ns"), getattr(msg, phase))
            if msg.ahead_ns:
                self.traces.mark(msg.move_id, "w_ahead", msg.ahead_ns)

    def _on_released(self, link: WorkerLink, msg: BlocksReleased) -> None:
        self._on_outcome(link, moves.release_outcome(msg, time.time_ns()))

    def _on_report(self, link: WorkerLink, msg: MovesReport) -> None:
        settled = recovery.reconcile(self.state, link.worker, msg, sorted(link.asked))
        for verdict, event in settled:
            self.metrics[f"reconciled_{verdict}"] += 1
            self._settle(event.move_id, event)
        for mid in [*msg.unknown, *(o.move_id for o in msg.outcomes if type(o) is not ev.MoveAcked)]:
            mv = self.state.stranded.get(mid)
            if mv is not None and mv.worker == link.worker:   # answered for: it will never run now
                self._stranded_answered(mid)
        link.asked.difference_update(msg.unknown)
        link.asked.difference_update(o.move_id for o in msg.outcomes)
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

    def _settle(self, mid: str, event: ev.Event) -> None:
        """Record a move's terminal (or late) event, its session follow-ups, and tell its asker.

        The ack of a lone move (the only one in flight), when no commit of ours is in flight, takes
        the short way: its events are committed here and an asker off the loop's thread (an
        operator's socket, the API's or a bench's future) answered before they are folded (the fold
        of a 1024-block ack is most of the control's work on it, ~0.15-0.4 ms on the H200). They are
        folded before this returns, so nothing the loop runs (the next message, a policy, a
        checkpoint, a ``call``, a loop-thread asker's callback) ever sees the state without them.
        With other moves in flight their acks come in bursts, and a commit (and a GIL yield) per
        ack would halve what the loop sustains (one-block moves on the 2-vCPU VM: 11.4k/s with
        group commits, 5.3k/s with one per ack, 3.3k/s with the yield too): those acks are
        committed together at the end of the loop's iteration, as any event.
        """
        mv = self.state.inflight.get(mid) or self.state.stranded.get(mid)
        if mv is None:
            return
        if self._awake:
            self._awake.pop(mid, None)
        if self._warm_at and self._warm_move == mid:    # its writer warm-up is moot now
            self._warm_at = 0
        short = type(event) is ev.MoveAcked and self._recorder.commits_inline and len(self.state.inflight) == 1
        recorded = [(self._record(e, correlation=mv.session, causation=mid, fold_later=short), e)
                    for e in moves.settle_events(mv, event, self.cfg.moves)]
        self.traces.mark(mid, "recorded")
        if type(event) is not ev.MoveLateAcked:
            waiter = self.book.settled(mid)
            if waiter is not None:
                waiter.events.extend(recorded)
                waiter.open.discard(mid)
                if waiter.done:
                    self._answer_after(waiter)
        if short:
            self._recorder.flush()          # durable (inline commit) ...
            self.traces.mark(mid, "ack_committed")
            self._answer_off_loop(len(mv.blocks))   # ... then the answer to an asker off this thread ...
            self._fold_deferred()           # ... then the bookkeeping (and any loop-thread asker)
            self.traces.mark(mid, "folded")
        if type(event) is not ev.MoveStranded:
            self.busy.remove(mv.worker, mv.blocks)
        if self._awake_moves:
            self._awake_done(mid)

    def _watch_deadlines(self) -> None:
        if self._commits_pending:
            now = time.monotonic_ns()
            for ref in [r for r, c in self._commits_pending.items() if c[5] < now]:
                waiter = self._commits_pending.pop(ref)[0]
                log.warning("commit_timeout", ref=ref)
                waiter.answer([], [], "commit_timeout", f"the worker did not answer commit {ref}")
        if not self.state.inflight:
            return
        now = time.time_ns() - int(self.cfg.deadline_grace_s * S)
        for e in watchdog.overdue(self.state, now, self.book.undispatched, self._adopting):
            log.warning("move_overdue", move_id=e.move_id, worker=e.worker, outcome=type(e).__name__)
            self._settle(e.move_id, e)

    def _requery(self, now: int) -> None:
        """Query workers about their stranded moves: a dropped ack comes back as MoveLateAcked."""
        stranded: dict[int, list[str]] = {}
        for mid, mv in self.state.stranded.items():
            if mid not in self.answered_stranded:
                stranded.setdefault(mv.worker, []).append(mid)
        for w, mids in stranded.items():
            link = self._by_worker.get(w)
            if link is not None:
                self._query(link, mids[:4096])

    def _run_policies(self) -> None:
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
            try:
                moves.validate(self.state, proposal, busy)
            except moves.InvalidAsk:
                continue
            refusal = moves.fund(self.state, [proposal], self.reserved_bytes())
            if refusal is not None:
                self.memo.note(proposal, refusal.available_bytes, now)
                log.info("move_refused", asker=proposal.origin, worker=proposal.worker, tier=refusal.tier,
                         asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
                self._record(refusal.event(proposal.origin, proposal.session), correlation=proposal.session)
                continue
            self._request(proposal, None)
