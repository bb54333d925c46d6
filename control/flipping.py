"""Flips on the control loop: sleep, wake and model flips from ask to verdict, and the requests
that wait for a model meanwhile (the pure steps are control/flip.py and control/flip_policy.py).

    ask / policy  check: invalid (nothing recorded), refused (MoveRefused), or a Run
    draining      the worker takes no new request (``holds``); those it runs end first
                  (past ``drain_s``: refused, naming them; nothing else recorded)
    parking       every idle session's device pages on it are parked (the moves' own events)
    shrinking     a sleep: the worker's device KV pool is resized to one block through the dial
                  (its own plan, refusals and write-ahead rebind, as ``ctl resize``); a refusal
                  is recorded and the sleep goes on: a sleep never waits on its pool
    swapping      FlipRequested + RebindRequested committed, then SwapWeights; WeightsSwapped
                  records the verdict (``on_swapped``); past the deadline, or with the worker
                  gone, the arena is stranded (``watch``, watchdog.overdue_flips)
    growing       a wake that completed (or a sleep the worker refused): the pool grows back to the
                  size the sleep took it from, then requests flow again

Requests for a model no worker serves now are held (``gate``) and tokenized meanwhile by a worker
that lists the model (its own tokenizer needs no weights): one the checks refuse is answered 400
at once; the others are released to a worker once one serves their model, keeping their tokens,
else answered 503 after ``wait_s`` naming what they waited for (the sleep, the flip, or a model
not resident). While a model has requests held that passed their checks (or could not be
tokenized early) and its worker's policy says so, a flip starts.

A tensor-parallel group (``serve --tp N``) flips, sleeps and wakes as one run asked of its leader
(a follower's ask is refused naming the leader): the leader's requests drain, its sessions park
and its pool is resized (the park and the dial take every rank with it); then a FlipRequested per
rank (``<fid>.r<rank>``), SwapWeights to each, and one verdict once every rank answered, or at the
deadline, or when a rank is lost: all completed, all refused, or torn and the group stopped
(control/flip_group.py).

The Flipper runs the state machine above; what has a table of its own is elsewhere: held requests
(control/flip_waiting.py), the pool a sleep gives back (control/flip_pool.py), the API's model
cards (control/flip_cards.py), the policy's pure choice (control/flip_policy.py ``pick``).

Loop thread only; ``cards`` and ``sleeping`` are snapshots replaced whole, read by the API.
"""
from __future__ import annotations

import time
from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.events.asks import AskAnswered, AskFlip, AskMove
from residency.events.commands import SwapWeights, WeightsSwapped
from residency.control import flip, flip_group, flip_policy, moves, watchdog
from residency.control.flip_cards import model_cards
from residency.control.flip_pool import KVPoolSteps
from residency.control.flip_run import Run, running_reason
from residency.control.flip_waiting import HeldRequests
from residency.control.scheduler.port import ModelCard

log = structlog.get_logger("control.flip")
S = 1_000_000_000
_BUSY = ("tokenizing", "restoring", "running")


class Flipper:
    def __init__(self, proc, workers, requests, asker, *, drain_s: float = 30.0, wait_s: float = 60.0,
                 deadline_s: float = 60.0, deadline_bytes_per_s: float = 0.5e9,
                 policy: flip_policy.FlipPolicyConfig = flip_policy.FlipPolicyConfig()):
        self.proc = proc
        self.workers = workers            # ServingWorkers: who serves, its ServingReady
        self.requests = requests          # RequestTable
        self.asker = asker
        self.drain_ns = int(drain_s * S)
        self.waiting = HeldRequests(proc, requests, wait_s)      # requests held for a model
        # a held request's early Tokenize was answered: it may go now, or count for the policy
        self.waiting.settled = lambda: (self.release(), self.consider())
        self.waiting.alive = lambda w: w in self.workers.alive()
        self.pool = KVPoolSteps(proc, lambda run: self.runs.get(run.worker) is run)
        self.deadline_s = deadline_s
        self.deadline_bytes_per_s = deadline_bytes_per_s
        self.policy = policy
        self.runs: dict[int, Run] = {}
        self.bandwidth: float | None = None           # bytes/s of the last flip measured (both ways)
        self.arena_gen: dict[int, int] = {}           # what each worker's arena carries (ServingReady, answers)
        self.since_ns: dict[int, int] = {}            # when each worker's model became resident
        # the models whose image a worker keeps in pinned host memory (ServingReady; then each flip
        # leaves the outgoing image in the host slab, where the incoming one was)
        self.on_host: dict[int, set[str]] = {}
        # NOTE: a flip the policy started that did not complete (the worker refused it, a request
        # did not end) would be started again at the next tick, and the next: the policy leaves
        # that worker alone for ``policy_backoff_s``, so a lasting "no" is recorded once a while
        self.policy_backoff_ns = 10 * S
        self._backoff: dict[int, int] = {}           # worker -> no policy flip before (monotonic ns)
        self.changed: Callable[[], None] = lambda: None   # Admission.retry_soon
        # serve --tp N: the ranks of a worker's group, leader first ([]: alone), and the group's stop
        # (control/scheduler/groups.py) for a flip whose ranks would not hold one model
        self.ranks_of: Callable[[int], list[int]] = lambda worker: []
        self.stop_group: Callable[[int, str], None] = lambda leader, reason: None
        self.ready: dict[int, object] = {}           # every worker's (every rank's) last ServingReady
        self._num = 0
        # replaced whole on the loop thread, read from the API thread
        self.cards: tuple[ModelCard, ...] = ()
        self.sleeping = False
        self.problems: tuple[str, ...] = ()

    # ================================================================== what the worker serves
    def on_ready(self, worker: int, msg) -> None:
        """A worker's ServingReady (a group's follower's too: its own models and arena)."""
        self.ready[worker] = msg
        self.arena_gen[worker] = msg.arena_gen
        self.on_host[worker] = {m.name for m in msg.models if m.host_image}
        self.pool.forget(worker)
        self.since_ns.setdefault(worker, time.monotonic_ns())
        self._refresh()

    def models_of(self, worker: int) -> dict[str, int]:
        """The worker's models -> their image bytes (ServingReady.models; a worker that lists none
        serves its one model, its bytes as the arena's books say)."""
        ready = self.ready.get(worker) or self.workers.ready.get(worker)
        if ready is None:
            return {}
        if ready.models:
            return {m.name: m.weights_bytes for m in ready.models}
        arena = flip.arena_of(self.proc.state, worker)
        return {ready.model: arena.bytes if arena is not None else 0}

    def holds(self, r) -> tuple[str, str] | None:
        """(code, reason) when request ``r`` may not be admitted on its worker now: a flip, sleep or
        wake runs there, the arena sleeps or is stranded, or it serves another model than ``r``
        names (``model_not_resident``: tokenized for a model flipped out since)."""
        w = r.worker
        run = self.runs.get(w)
        if run is not None:
            return running_reason(run)
        why = flip.closed(self.proc.state, w)
        if why is not None:
            return why
        arena = flip.arena_of(self.proc.state, w)
        if arena is not None and r.req.model and len(self.models_of(w)) > 1 and arena.model != r.req.model:
            return ("model_not_resident", f"worker {w} serves {arena.model!r} now, not {r.req.model!r}")
        return None

    def serving(self, model: str | None) -> list[int]:
        """Alive workers that serve ``model`` now (any model: None)."""
        state = self.proc.state
        out = []
        for w in self.workers.alive():
            if w in self.runs:
                continue
            arena = flip.arena_of(state, w)
            if arena is None:           # no arena on the books: the model it said it serves
                if model is None or self.workers.ready[w].model == model:
                    out.append(w)
            elif flip.closed(state, w) is None and (model is None or arena.model == model
                                                      or len(self.models_of(w)) <= 1):
                out.append(w)
        return out

    # ================================================================== requests held for a model
    def gate(self, r) -> bool:
        """True when ``r`` is held (no alive worker serves its model now); it starts over through
        ``begin`` once one does, or is refused after ``wait_s``."""
        if self.workers.sched is None or not self.workers.alive() or self.serving(r.req.model):
            return False
        cands = self.workers.alive()
        lists = [w for w in cands if any(m.name == r.req.model for m in self.workers.ready[w].models)]
        self.waiting.hold(r, *self._why_held(r.req.model), worker=cands[0] if cands else -1, tokenizers=lists)
        self.consider()
        return True

    def _why_held(self, model: str) -> tuple[str, str]:
        state = self.proc.state
        for w in self.workers.alive():
            if w in self.runs:
                return running_reason(self.runs[w])
            why = flip.closed(state, w)
            if why is not None:
                return why
        return ("model_not_resident", f"no worker serves {model!r} now; a flip to it waits for the flip policy")

    def release(self) -> None:
        """Start over every held request whose model a worker serves now."""
        self.waiting.release(self.serving)

    # ================================================================== asks
    def on_ask(self, msg: AskFlip, asker: str, waiter: moves.AskWaiter) -> None:
        """The operator's ask (``ctl flip``, the admin and sleep routes); raises moves.InvalidAsk."""
        origin = f"{asker}:{msg.action}"
        if msg.worker is not None:
            targets = [msg.worker]
        elif msg.action == "flip":
            alive = self.workers.alive()
            if not alive:
                raise moves.InvalidAsk("no worker is serving")
            targets = [next((w for w in alive if (a := flip.arena_of(self.proc.state, w)) is None
                             or a.model != msg.to_model), alive[0])]
        else:
            targets = self.workers.alive()
            if not targets:
                raise moves.InvalidAsk("no worker is serving")
        for w in targets:       # every worker checked before any starts: an invalid ask changes nothing
            self._check(w, msg.action, msg.to_model, msg.level)
        for w in targets:
            self.start(w, msg.action, msg.to_model, msg.level, origin, waiter, causation=msg.ask_id or None)

    def _check(self, worker: int, action: str, to_model: str, level: int) -> list[flip.FlipPlan] | flip.FlipRefused:
        """Every rank's plan (a worker alone: its own), or the first refusal among them; raises
        InvalidAsk for one that names nothing, or names a follower rank of a group."""
        ranks = self.ranks_of(worker) or [worker]
        if ranks[0] != worker:      # a rank's own view never decides: the leader's flip is the group's
            raise moves.InvalidAsk(f"worker {worker} is a follower rank of a tensor-parallel group: ask its "
                                   f"leader, worker {ranks[0]}, and every rank's weights {action} with it")
        plans = []
        for w in ranks:
            try:
                got = flip.check(self.proc.state, w, action, to_model, level, self.models_of(w))
            except flip.InvalidFlip as e:
                raise moves.InvalidAsk(str(e) if w == worker else f"rank worker {w} of the group: {e}") from None
            if isinstance(got, flip.FlipRefused):
                return got
            plans.append(got)
        return plans

    def start(self, worker: int, action: str, to_model: str, level: int, origin: str, waiter: moves.AskWaiter,
              causation: str | None = None) -> None:
        got = self._check(worker, action, to_model, level)
        running = next((self.runs[w] for w in self.ranks_of(worker) or [worker] if w in self.runs), None)
        if running is not None and not isinstance(got, flip.FlipRefused):
            got = flip.FlipRefused(worker=worker, action=action, code="flip_in_progress",
                                   asked_bytes=got[0].bytes_in,
                                   reason=f"a {running.plan.action} of worker {running.worker} is running "
                                          f"({running.phase}); ask again once it has ended")
        if isinstance(got, flip.FlipRefused):
            e = got.event(origin)
            log.info("flip_refused", worker=worker, action=action, code=got.code, reason=got.reason)
            waiter.events.append((self.proc.record(e, causation=causation), e))
            return
        self._num += 1
        run = Run(got[0], origin, waiter, f"flip:{worker}:{self._num}", time.monotonic_ns(), causation, plans=got)
        for w in run.ranks:
            self.runs[w] = run
        waiter.open.add(run.ref)
        log.info("flip_started", worker=worker, ranks=run.ranks, action=action, to_model=to_model or None,
                 origin=origin)
        # NOTE: the first step runs after this handler returns: a run that ends at once (its
        # requests did not end in time, its worker is gone) answers through ``finish_ask``, and
        # the ask handler, which answers a waiter it finds done on return, must not find it so
        self.proc.call(lambda _proc, run=run: self._advance(run))
        self._refresh()

    # ================================================================== draining, parking, swapping
    def _advance(self, run: Run) -> None:
        if self.runs.get(run.worker) is not run:
            return
        if run.phase == "draining":
            busy = sorted(r.request_id for r in self.requests.by_id.values()
                          if r.worker == run.worker and r.phase in _BUSY)
            if busy:
                if time.monotonic_ns() - run.since_ns > self.drain_ns:
                    self._give_up(run, "requests_running",
                                  f"{len(busy)} request(s) still run on worker {run.worker} after "
                                  f"{self.drain_ns // S} s: {busy[:8]}")
                return
            run.phase = "parking"
            for s in self._device_sessions(run.worker):
                run.parks.add(s)
                self.asker.ask(AskMove(ask_id=self.asker.new_id("park"), kind="park", worker=run.worker, session=s),
                               "serving", lambda ans, s=s, run=run: self._parked(run, s, ans))
        if run.phase == "parking" and not run.parks:
            self.pool.shrink(run, self._swap)

    def _device_sessions(self, worker: int) -> list[str]:
        sched = self.workers.sched
        if sched is None:
            return []
        wb = self.proc.state.blocks.get(worker, {})
        return sorted(e.session for e in sched.sessions.values() if e.worker == worker and e.busy is None
                      and any(b in wb and "device" in wb[b].tiers for b in e.blocks))

    def _parked(self, run: Run, session: str, ans: AskAnswered) -> None:
        run.waiter.events.extend(zip(ans.seqs, ans.events))
        run.parks.discard(session)
        if self.runs.get(run.worker) is not run or run.phase != "parking":
            return
        ok = ans.error is None and all(type(e) is ev.MoveAcked for e in ans.events
                                       if type(e) in (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected, ev.MoveRefused,
                                                      ev.MoveStranded, ev.MoveAbandoned))
        if not ok:
            why = ans.detail or ", ".join(type(e).__name__ for e in ans.events) or "no answer"
            self._give_up(run, "park_failed", f"the park of session {session!r} on worker {run.worker} did not "
                                              f"complete ({ans.error or why}); its device pages would not survive "
                                              f"the {run.plan.action}")
            return
        if not run.parks:
            self.pool.shrink(run, self._swap)

    def _give_up(self, run: Run, code: str, reason: str) -> None:
        refused = flip.FlipRefused(worker=run.worker, action=run.plan.action, code=code, reason=reason,
                                   asked_bytes=run.plan.bytes_in)
        e = refused.event(run.origin)
        log.warning("flip_refused", worker=run.worker, action=run.plan.action, code=code, reason=reason)
        run.waiter.events.append((self.proc.record(e, causation=run.causation), e))
        self._finish(run)

    def _grow(self, run: Run) -> bool:
        """The pool back to the size the sleep took it from, then the run ends; False: not shrunk."""
        return self.pool.grow(run, self._finish)

    # ================================================================== the swap
    def _swap(self, run: Run) -> None:
        """Write ahead every rank's FlipRequested and rebind; SwapWeights to each once committed."""
        gone = [w for w in run.ranks if w not in self.proc.workers.by_worker]
        if gone:
            self._give_up(run, "worker_unavailable", f"worker {gone[0]} is not linked to this control process")
            return
        self._num += 1
        fid = flip.flip_id(self.proc.epoch, self._num)
        nbytes = max(p.bytes_out + p.bytes_in for p in run.plans.values())
        deadline_ns = time.time_ns() + int((self.deadline_s + nbytes / self.deadline_bytes_per_s) * S)
        # the pool a sleep shrank is the group's, resized from the leader's books: the leader's
        # FlipRequested carries its size back to the wake
        kv_pool = self.pool.before_sleep(run.worker)
        run.phase, cmds = "swapping", []
        for k, (w, plan) in enumerate(run.plans.items()):
            rfid = flip_group.rank_flip_id(fid, k, len(run.ranks))
            req, rebind = flip.requested(self.proc.state, plan, rfid, self.arena_gen.get(w, 0), deadline_ns,
                                         kv_pool_bytes=kv_pool if w == run.worker else None)
            run.reqs[w] = req
            for e in (req, rebind):
                run.waiter.events.append((self.proc.record(e, causation=run.causation or run.origin), e))
            arena = flip.arena_of(self.proc.state, w)
            run.stakes[w] = arena.inflight_bytes if arena is not None else max(plan.bytes_in, plan.bytes_out)
            cmds.append((w, SwapWeights(flip_id=rfid, action=plan.action, to_model=plan.to_model,
                                        level=max(plan.level, 1), to_gen=req.to_gen, deadline_ns=deadline_ns)))
        run.req, run.at_stake = run.reqs[run.worker], run.stakes[run.worker]
        # write-ahead: the commands leave once every rank's FlipRequested and rebind are committed
        gate = moves.AskWaiter(fid, lambda *_a, run=run, cmds=cmds: self._send(run, cmds))
        gate.events.append(run.waiter.events[-1])
        self.proc.answers.after_commit(gate)
        self._refresh()

    def _send(self, run: Run, cmds: list[tuple[int, SwapWeights]]) -> None:
        if self.runs.get(run.worker) is not run:
            return
        for w, cmd in cmds:
            if not self.proc.send_to_worker(w, cmd):
                log.warning("flip_not_sent", flip_id=cmd.flip_id, worker=w)     # stranded at the deadline
            else:
                log.info("flip_sent", flip_id=cmd.flip_id, worker=w, action=cmd.action, to_gen=cmd.to_gen)

    def on_swapped(self, link, msg: WeightsSwapped) -> None:
        run = self.runs.get(link.worker)
        if not msg.error:
            self.arena_gen[link.worker] = msg.to_gen      # what the worker's arena carries now
        req = run.reqs.get(link.worker) if run is not None else None
        if req is None or req.flip_id != msg.flip_id or link.worker in run.answers:
            log.warning("swapped_unexpected", worker=link.worker, flip_id=msg.flip_id, error=msg.error or None)
            return
        run.answers[link.worker] = msg
        log.info("flip_answered", flip_id=req.flip_id, worker=link.worker, action=req.action,
                 error=msg.error or None, bytes_out=msg.bytes_out, bytes_in=msg.bytes_in,
                 measured_freed_bytes=msg.measured_freed_bytes)
        if len(run.answers) == len(run.ranks):        # every rank answered: one verdict for all
            self._decide(run)

    def _decide(self, run: Run, silent_why: str = "") -> None:
        """The verdict of every rank (``flip_group``: all completed, all refused, or torn and the
        group stopped); a rank with no answer (``silent_why``: the deadline, its loss) is behind."""
        kind = flip_group.outcome(run.reqs, run.answers)
        if len(run.ranks) == 1 or kind != "torn":    # a worker alone: its answer as it is (worker_answer)
            recorded = [x for w in run.ranks for x in self._record_rank(run, w)]
            completed = any(type(e) is ev.FlipCompleted for _, e in recorded)
            refused = not completed and not any(type(e) is ev.FlipFailed and e.stranded for _, e in recorded)
        else:
            events, why = flip_group.torn(run.reqs, run.answers, run.stakes, silent_why)
            recorded = [(self.proc.record(e, causation=run.req.flip_id), e) for e in events]
            completed = refused = False
            log.error("flip_group_torn", flip_id=run.req.flip_id, ranks=run.ranks, why=why)
            self.stop_group(run.worker, why)
        run.waiter.events.extend(recorded)
        msg = run.answers.get(run.worker)
        if completed and msg is not None:
            took_s = (msg.finished_ns - msg.started_ns) / S
            if took_s > 0 and msg.bytes_in + msg.bytes_out > 0:
                self.bandwidth = (msg.bytes_in + msg.bytes_out) / took_s
            self.since_ns[run.worker] = time.monotonic_ns()
            if run.req.action == "flip":
                for w in run.ranks:
                    self.on_host[w] = {run.req.from_model}
        log.info("flip_decided", flip_id=run.req.flip_id, ranks=run.ranks, outcome=kind,
                 verdict=type(recorded[-1][1]).__name__ if recorded else None)
        # the pool grows back once the weights are (a wake), or when the worker refused the sleep
        # and kept its weights (nothing changed but the pool); requests wait for it: still in ``runs``
        action = run.req.action
        if ((action == "wake" and completed) or (action == "sleep" and refused)) and self._grow(run):
            return
        self._finish(run)

    def _record_rank(self, run: Run, w: int) -> list:
        """One rank's answer as the worker gave it: FlipCompleted (its measured bytes) with its
        readers' stamps and rebind verdict, or FlipFailed with RebindRefused or RebindTorn."""
        req, msg = run.reqs[w], run.answers[w]
        recorded = [(self.proc.record(e, causation=req.flip_id), e)
                    for e in flip.worker_answer(req, msg, run.stakes[w])]
        if any(type(e) is ev.FlipCompleted for _, e in recorded):
            stamped = {flip.WORKER}
            if flip.router_at(self.proc.state, req):      # after FlipCompleted is folded: it sees the image
                e = ev.ReaderStamped(rebind_id=req.flip_id, reader=flip.ROUTER, gen=req.to_gen)
                recorded.append((self.proc.record(e, causation=req.flip_id), e))
                stamped.add(flip.ROUTER)
            e = flip.verdict(req, stamped)
            recorded.append((self.proc.record(e, causation=req.flip_id), e))
        return recorded

    # ================================================================== the tick
    def _each_run(self) -> list[Run]:
        """Every run once (a group's is under each of its ranks)."""
        return list({id(r): r for r in self.runs.values()}.values())

    def watch(self, now_ns: int | None = None) -> None:
        """Strand the flips past their deadline or whose worker went; move the runs waiting on
        their worker's requests; answer held requests that waited too long; ask the policy."""
        for fid, why in watchdog.overdue_flips(self.proc.state, time.time_ns() if now_ns is None else now_ns):
            if fid in self.proc.state.flips:      # a group's verdict may have ended its peers' already
                self._strand(fid, why)
        for run in self._each_run():
            if run.phase == "draining":
                self._advance(run)
        self.waiting.expire(time.monotonic_ns(), self._why_held)
        self.release()          # one whose Tokenize went unanswered (its worker lost or stalled) goes now
        self.consider()
        self._refresh()

    def _strand(self, fid: str, why: str) -> None:
        run = next((r for r in self._each_run() if any(q.flip_id == fid for q in r.reqs.values())), None)
        if run is not None and len(run.ranks) > 1:    # a rank silent or lost: the group's verdict now
            self._decide(run, silent_why=why)
            return
        arena = self.proc.state.arenas.get(self.proc.state.flips.get(fid, ""))
        at_stake = run.at_stake if run is not None else (arena.inflight_bytes if arena is not None else None)
        events: list[ev.Event] = [ev.FlipFailed(flip_id=fid, error=why, stranded=True, stranded_bytes=at_stake)]
        rb = self.proc.state.rebinds.get(fid)
        if rb is not None and rb.status == "requested":
            events.append(ev.RebindTorn(rebind_id=fid, readers_behind=sorted(rb.readers)))
        log.error("flip_stranded", flip_id=fid, why=why, stranded_bytes=at_stake)
        recorded = [(self.proc.record(e, causation=fid), e) for e in events]
        if run is not None:
            run.waiter.events.extend(recorded)
            self._finish(run)

    def stop(self, reason: str) -> None:
        """The control stops: a flip still unanswered strands its arena (its image is unknown to
        the next start); every asker hears what was recorded; held requests are answered."""
        for run in self._each_run():
            if run.phase == "swapping" and run.req is not None and run.req.flip_id in self.proc.state.flips:
                self._strand(run.req.flip_id, f"the control process stopped ({reason}) with the flip in flight")
            else:
                self._finish(run)
        self.waiting.stop(reason)

    def _finish(self, run: Run) -> None:
        for w in run.ranks:
            if self.runs.get(w) is run:
                del self.runs[w]
        if run.origin == "policy:flip" and not any(type(e) is ev.FlipCompleted for _, e in run.waiter.events):
            self._backoff[run.worker] = time.monotonic_ns() + self.policy_backoff_ns
        self.proc.finish_ask(run.waiter, run.ref)
        self._refresh()
        self.release()
        self.changed()

    # ================================================================== the policy
    def consider(self) -> None:
        """Flip a worker toward the model its held requests wait for, when the policy says so."""
        if not self.waiting:
            return
        state = self.proc.state
        now = time.monotonic_ns()
        cands = []
        for w in self.workers.alive():
            arena = flip.arena_of(state, w)
            if w in self.runs or arena is None or flip.closed(state, w) is not None or self._backoff.get(w, 0) > now:
                continue        # busy, asleep (an operator's state) or stranded (an operator repairs it)
            models = self.models_of(w)
            if len(models) >= 2:
                in_hand = sum(1 for r in self.requests.by_id.values() if r.worker == w)
                cands.append(flip_policy.Candidate(worker=w, resident=arena.model, in_hand=in_hand,
                                                   resident_since_ns=self.since_ns.get(w, 0), image_bytes=models))
        got = flip_policy.pick(now, self.waiting.backlog(), cands, self.bandwidth, self.policy)
        if got is None:
            return
        w, d = got
        log.info("flip_policy", worker=w, to_model=d.to_model, reason=d.reason)
        waiter = moves.AskWaiter(f"policy-flip-{w}", lambda events, _m, error, detail, w=w: log.info(
            "policy_flip_done", worker=w, outcome=[type(e).__name__ for _, e in events][-2:], error=error))
        self.start(w, "flip", d.to_model, 0, "policy:flip", waiter, causation=f"policy:flip: {d.reason}")
        if waiter.done:
            self.proc.answers.after_commit(waiter)

    # ================================================================== what the API shows
    def _refresh(self) -> None:
        self.cards, self.sleeping = model_cards(self.proc.state, self.workers.ready, self.on_host)
        self.problems = tuple(flip.stranded_arenas(self.proc.state))


__all__ = ["Flipper", "Run"]
