"""Outside tenants' reclaims and releases, on the control loop: the process shell around the pure
planner (control/reclaim.py).

    AskReclaim ─► tenant declared? bytes > 0? nothing else resizing?   no: invalid ask, nothing recorded
               ─► candidates (idle pages by route) ─► plan_reclaim
                      refused: MoveRefused(ask="tenant:<name>") with the arithmetic; nothing moved
               ─► the plan's moves, all asked at once (releases of retained prefixes' device
                  copies, parks, evictions), each written ahead and answered by its worker
                      one failed/refused/stranded: TenantReclaimFailed naming the stranded bytes
               ─► the dial shrinks the device pool by the grant (whole pages)
                      refused/torn: TenantReclaimFailed with the dial's words
               ─► TenantReclaimed{granted, freed by the moves, measured by the driver | None}
    AskReleaseTenant ─► the dial grows the pool by the tenant's grant ─► TenantReleased

A tensor-parallel group (``serve --tp``) is asked through its leader (a follower is refused,
naming it). Its page is every rank's shard of one block, so the planner counts the group's bytes:
the ask is rounded up to whole group pages, the moves are group moves, the dial shrinks every
rank's pool by those pages, and each rank records its own ``TenantReclaimed`` (its shard's bytes,
its own freed and measured bytes, its rebind), so each worker's books say whose its memory is.
A release grows every rank back and records a ``TenantReleased`` per rank the same way.

Loop thread only. The dial is a callable given after construction (``dial``):
``dial(worker, to_bytes, origin, then)``; ``then`` gets a ``DialOutcome``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import structlog

from residency.control.budget import available_bytes
from residency.control.reclaim import Candidate, Pool, ReclaimRefused, pages_for, plan_reclaim
from residency.control.scheduler.asker import Asker
from residency.control.scheduler.retain import is_retained
from residency.control.scheduler.workers import ServingWorkers
from residency.control.moves import AskWaiter, InvalidAsk
from residency.control.tenants import Tenant, TenantError, lookup
from residency.events import catalog as ev
from residency.events.asks import AskAnswered, AskMove, AskReclaim, AskReleaseBlocks, AskReleaseTenant

log = structlog.get_logger("control.reclaim")
BAD = (ev.MoveFailed, ev.MoveRejected, ev.MoveRefused, ev.MoveStranded, ev.MoveAbandoned)


@dataclass(frozen=True)
class DialOutcome:
    """What the dial answered for one resize: ``error`` None when the pool now has ``to_bytes``
    and every reader carries its new generation. ``events``: what the dial recorded, (seq, event)."""

    rebind_id: str
    to_bytes: int
    measured_freed_bytes: int | None      # driver's free after less before (a grow: negative); None: not measured
    error: str | None = None
    events: tuple = ()

    def by_rank(self, worker: int) -> tuple[str, int | None]:
        """(rebind id, measured freed bytes) of ``worker``'s own pool in this resize (one rank of a
        group, or the worker alone)."""
        rid = next((e.rebind_id for _, e in self.events if type(e) is ev.RebindRequested and e.worker == worker),
                   self.rebind_id)
        resized = next((e for _, e in self.events if type(e) is ev.PoolResized and e.worker == worker), None)
        return rid, resized.measured_freed_bytes if resized is not None else None


def dial_of(proc) -> Callable:
    """The control process's dial (control/dialing.py, made when the loop starts) as the
    reclaimer calls it: ``resize(worker, to_bytes, origin, then)``; ``then`` gets a DialOutcome
    once everything the resize recorded is committed."""
    def resize(worker: int, to_bytes: int, origin: str, then: Callable[[DialOutcome], None]) -> None:
        def answered(events, _move_ids, error, detail) -> None:
            then(outcome_of(to_bytes, list(events), error, detail))
        proc.dial.resize(worker, "device", to_bytes, origin, AskWaiter(f"{origin}:resize", answered),
                         causation=origin)
    return resize


def outcome_of(to_bytes: int, events: list, error: str | None = None, detail: str = "") -> DialOutcome:
    """A DialOutcome from what the dial recorded: committed only with a ``RebindCommitted``."""
    rid = next((e.rebind_id for _, e in events if type(e) is ev.RebindRequested), "")
    resized = [e for _, e in events if type(e) is ev.PoolResized]
    # every rank's pool (a group) or the worker's: None unless each was measured, never a partial sum
    measured = (None if not resized or any(e.measured_freed_bytes is None for e in resized)
                else sum(e.measured_freed_bytes for e in resized))
    if error is None and any(type(e) is ev.RebindCommitted for _, e in events):
        return DialOutcome(rebind_id=rid, to_bytes=to_bytes, measured_freed_bytes=measured, events=tuple(events))
    words = error and f"{error}: {detail}"
    for _, e in events:
        t = type(e).__name__
        if t in ("MoveRefused", "RebindRefused", "RebindTorn", "MoveFailed", "MoveRejected", "MoveStranded"):
            why = (getattr(e, "reason", "") or getattr(e, "error", "") or getattr(e, "why", "")
                   or f"readers behind: {getattr(e, 'readers_behind', '')}")
            words = f"{t}: {why}"
            break
    return DialOutcome(rebind_id=rid, to_bytes=to_bytes, measured_freed_bytes=measured,
                       error=words or "the dial answered without a committed rebind", events=tuple(events))


class Reclaimer:
    def __init__(self, proc, workers: ServingWorkers, asker: Asker, tenants: dict[str, Tenant]):
        self.proc = proc
        self.workers = workers
        self.asker = asker
        self.tenants = tenants
        self.dial: Callable | None = None         # dial(worker, to_bytes, origin, then(DialOutcome))
        self.busy_with: str | None = None         # the ask under way (one reclaim or release at a time)

    # ------------------------------------------------------------------ asks (loop thread)
    def _check(self, tenant: str, worker: int) -> Tenant:
        try:
            t = lookup(self.tenants, tenant)
        except TenantError as e:
            raise InvalidAsk(str(e)) from None
        ranks = self.ranks(worker)
        if ranks[0] != worker:
            raise InvalidAsk(f"worker {worker} is a follower rank of a tensor-parallel group: ask its leader, worker "
                             f"{ranks[0]}; the group's pool gives up (and takes back) the same pages on every rank")
        ws = self.proc.state.workers.get(worker)
        if ws is None or not ws.alive or worker not in self.workers.ready:
            raise InvalidAsk(f"worker {worker} is not serving (serving: {sorted(self.workers.alive())})")
        if self.busy_with is not None:
            raise InvalidAsk(f"busy: {self.busy_with} is under way; ask again when it is answered")
        if self.dial is None:
            raise InvalidAsk("this server has no dial to resize its device pool with")
        held = self.resizing(worker)
        if held is not None:
            raise InvalidAsk(f"busy: {held}; ask again when it is answered")
        return t

    def ranks(self, worker: int) -> list[int]:
        """The ranks of ``worker``'s tensor-parallel group, leader first ([worker]: alone)."""
        dialer = getattr(self.proc, "dial", None)
        return (dialer.ranks_of(worker) if dialer is not None else []) or [worker]

    def pool(self, worker: int, ranks: list[int]) -> Pool:
        """``worker``'s device pool as the next admission sees it. A group's page is every rank's
        shard of one block: its bytes, capacity, floor and host room count every rank (the floor
        and host room in whole pages, those of the tightest rank)."""
        state = self.proc.state
        ws = state.workers[worker]
        acc = ws.tiers["device"]
        _, free_pages = self.workers.sched.device_room(state, worker)
        context = self.workers.context_floor(worker)
        ctx = context.pages if context is not None else 0
        if len(ranks) == 1:
            return Pool(worker=worker, block_bytes=ws.block_bytes, capacity_bytes=acc.capacity_bytes,
                        free_pages=free_pages, floor_bytes=acc.floor_bytes,
                        host_room_bytes=available_bytes(ws.tiers["host"]), context_pages=ctx)
        rs = [state.workers[r] for r in ranks]
        page = sum(r.block_bytes for r in rs)
        floor = max(pages_for(r.tiers["device"].floor_bytes, r.block_bytes) for r in rs)
        room = min(available_bytes(r.tiers["host"]) // r.block_bytes for r in rs)
        return Pool(worker=worker, block_bytes=page, capacity_bytes=acc.capacity_bytes // ws.block_bytes * page,
                    free_pages=free_pages, floor_bytes=floor * page, host_room_bytes=room * page, context_pages=ctx)

    def resizing(self, worker: int) -> str | None:
        """Why the worker's pool cannot be resized now (a resize under way, a torn pool), or None."""
        dialer = getattr(self.proc, "dial", None)
        if dialer is None:
            return None
        if worker in dialer.runs:
            return f"a resize of worker {worker}'s device pool is under way"
        held = dialer.holds(worker)
        return None if held is None else held[1]

    def on_reclaim(self, msg: AskReclaim, asker: str, waiter) -> None:
        if msg.bytes <= 0:
            raise InvalidAsk(f"bytes must be > 0, not {msg.bytes}")
        tenant = self._check(msg.tenant, msg.worker)
        ranks = self.ranks(msg.worker)
        pool = self.pool(msg.worker, ranks)
        plan = plan_reclaim(tenant.name, tenant.routes, pool, self.candidates(msg.worker), msg.bytes)
        if isinstance(plan, ReclaimRefused):
            e = plan.event()
            log.info("reclaim_refused", tenant=tenant.name, worker=msg.worker, asked_bytes=plan.granted_bytes,
                     available_bytes=plan.available_bytes)
            waiter.events.append((self.proc.record(e, causation=msg.ask_id or None), e))
            return
        ref = f"reclaim:{msg.ask_id}"
        self.busy_with = f"the reclaim {msg.ask_id} of tenant {tenant.name}"
        waiter.open.add(ref)
        log.info("reclaim_planned", tenant=tenant.name, worker=msg.worker, granted_bytes=plan.granted_bytes,
                 pages_to_empty=plan.pages_to_empty, steps=len(plan.steps))
        run = _Run(self, plan, msg, waiter, ref, pool.block_bytes, ranks)
        run.start()

    def on_release(self, msg: AskReleaseTenant, asker: str, waiter) -> None:
        tenant = self._check(msg.tenant, msg.worker)
        ws = self.proc.state.workers[msg.worker]
        held = ws.tenants.get(tenant.name, 0)
        ranks = self.ranks(msg.worker)
        if held <= 0:
            raise InvalidAsk(f"tenant {tenant.name!r} holds nothing on worker {msg.worker} "
                             f"(grants there: {dict(ws.tenants) or 'none'})")
        ref = f"release:{msg.ask_id}"
        self.busy_with = f"the release {msg.ask_id} of tenant {tenant.name}"
        waiter.open.add(ref)
        to_bytes = ws.tiers["device"].capacity_bytes + held

        def resized(out: DialOutcome) -> None:
            self.busy_with = None
            if out.error is not None:
                es = [ev.TenantReclaimFailed(tenant=tenant.name, worker=msg.worker, asked_bytes=held,
                                             reason=f"release: the pool did not grow back to {to_bytes}, the grant "
                                                    f"stays the tenant's: {out.error}")]
            else:     # each rank gives back its own share (a worker alone: its whole grant)
                es = []
                for w in ranks:
                    share = self.proc.state.workers[w].tenants.get(tenant.name, 0)
                    if share > 0:
                        rid, measured = out.by_rank(w)
                        es.append(ev.TenantReleased(tenant=tenant.name, worker=w, bytes=share, rebind_id=rid,
                                                    measured_bytes=None if measured is None else -measured))
            waiter.events.extend(out.events)
            for e in es:
                waiter.events.append((self.proc.record(e, causation=msg.ask_id or None), e))
            self.proc.finish_ask(waiter, ref)
        self._resize(msg.worker, to_bytes, f"tenant:{tenant.name}", resized)

    def _resize(self, worker: int, to_bytes: int, origin: str, then) -> None:
        try:
            self.dial(worker, to_bytes, origin, then)
        except Exception as e:  # noqa: BLE001 - the ask is answered with the dial's words
            log.exception("dial_failed", worker=worker, to_bytes=to_bytes)
            then(DialOutcome(rebind_id="", to_bytes=to_bytes, measured_freed_bytes=None, error=repr(e)))

    # ------------------------------------------------------------------ candidates
    def candidates(self, worker: int) -> list[Candidate]:
        """Idle device pages of ``worker`` by route: retained prefixes and idle sessions whole,
        and single pages coldest first (sessions least recently used first, each from its tail,
        so the prefix the next turn reads stays longest; pages of no session first of all)."""
        state = self.proc.state
        wb = state.blocks.get(worker, {})
        sched = self.workers.sched
        busy = set(sched.busy_blocks().get(worker, ())) | set(self.proc.moves.busy.by_worker.get(worker, ()))
        busy_sessions = sched.busy_sessions()

        def idle_device(pages) -> tuple[int, ...]:
            return tuple(b for b in pages if b in wb and "device" in wb[b].tiers and b not in busy)

        def to_copy(pages) -> int:
            return sum(1 for b in pages if "host" not in wb[b].tiers)

        whole: list[Candidate] = []
        single: list[tuple[int, int, Candidate]] = []
        owned: set[int] = set()
        entries = sorted((e for e in sched.sessions.values() if e.worker == worker), key=lambda e: e.last_used_ns)
        for e in entries:
            owned.update(e.blocks)
            if e.session in busy_sessions or e.busy is not None:
                continue
            pages = idle_device(e.blocks)
            if not pages:
                continue
            if is_retained(e.session):
                whole.append(Candidate(route="prefixes", session=e.session, pages=pages, to_copy=0))
            else:
                whole.append(Candidate(route="park", session=e.session, pages=pages, to_copy=to_copy(pages)))
            for i, b in enumerate(reversed(pages)):
                single.append((e.last_used_ns, i, Candidate(route="evict", session=e.session, pages=(b,),
                                                            to_copy=to_copy((b,)))))
        loose = idle_device(b for b, st in wb.items() if st.session is None and b not in owned)
        return whole + [Candidate(route="evict", session=None, pages=(b,), to_copy=to_copy((b,))) for b in loose] + [
            c for _, _, c in sorted(single, key=lambda t: (t[0], t[1]))]


class _Run:
    """One reclaim under way: its moves, then the dial."""

    def __init__(self, owner: Reclaimer, plan, msg: AskReclaim, waiter, ref: str, page_bytes: int,
                 ranks: list[int]):
        self.owner, self.plan, self.msg, self.waiter, self.ref = owner, plan, msg, waiter, ref
        self.proc = owner.proc
        self.page_bytes = page_bytes          # the plan's page: every rank's shard of one block
        self.ranks = ranks                    # leader first; [worker] alone
        self.pending = 0
        self.move_ids: list[str] = []
        self.move_worker: dict[str, int] = {}     # move id -> the rank it ran on
        self.sessions: list[str] = []
        self.freed_bytes: dict[int, int] = {}     # rank -> device bytes its moves' answers freed
        self.bad: list[ev.Event] = []
        self.errors: list[str] = []

    def start(self) -> None:
        asks = []
        evict: dict[str | None, list[int]] = {}
        for s in self.plan.steps:
            if s.route == "prefixes":
                asks.append(AskReleaseBlocks(ask_id=self.owner.asker.new_id("reclaim-drop"), worker=self.msg.worker,
                                             tier="device", blocks=list(s.pages),
                                             reason=f"reclaim for tenant {self.plan.tenant}", session=s.session))
                self.sessions.append(s.session)
            elif s.route == "park":
                asks.append(AskMove(ask_id=self.owner.asker.new_id("reclaim-park"), kind="park",
                                    worker=self.msg.worker, blocks=list(s.pages), session=s.session))
                self.sessions.append(s.session)
            else:
                evict.setdefault(s.session, []).extend(s.pages)
        for session, pages in evict.items():
            asks.append(AskMove(ask_id=self.owner.asker.new_id("reclaim-evict"), kind="evict", worker=self.msg.worker,
                                blocks=pages, session=session))
        if not asks:
            self.moved()
            return
        self.pending = len(asks)
        for a in asks:
            self.owner.asker.ask(a, f"tenant:{self.plan.tenant}", self.answered)

    def answered(self, ans: AskAnswered) -> None:
        self.pending -= 1
        self.move_ids.extend(ans.move_ids)
        self.waiter.events.extend(zip(ans.seqs, ans.events))
        if ans.error is not None:
            self.errors.append(f"{ans.error}: {ans.detail}")
        for e in ans.events:
            t = type(e)
            if getattr(e, "move_id", None) and isinstance(getattr(e, "worker", None), int):
                self.move_worker[e.move_id] = e.worker
            if t in BAD:
                self.bad.append(e)
            elif t is ev.MoveAcked:
                self.freed_bytes[e.worker] = self.freed_bytes.get(e.worker, 0) + e.bytes_freed_src
            elif t is ev.CopiesReleased and e.tier == "device":
                self.freed_bytes[e.worker] = self.freed_bytes.get(e.worker, 0) + e.bytes
        if self.pending == 0:
            self.moved()

    def moved(self) -> None:
        stranded = [e for e in self.bad if type(e) is ev.MoveStranded]
        if self.bad or self.errors:
            words = [f"{type(e).__name__} {getattr(e, 'move_id', '') or getattr(e, 'ask', '')}: "
                     f"{getattr(e, 'reason', '') or getattr(e, 'error', '') or getattr(e, 'why', '')}"
                     for e in self.bad] + self.errors
            self.fail("a move the reclaim needed did not land: " + "; ".join(words[:6]),
                      stranded_bytes=sum(e.bytes_at_risk for e in stranded),
                      stranded_moves=[e.move_id for e in stranded])
            return
        # NOTE: requests admitted while the moves ran may have taken the emptied slots
        state, w = self.proc.state, self.msg.worker
        _, free_pages = self.owner.workers.sched.device_room(state, w)
        pages = self.plan.granted_bytes // self.page_bytes
        need = pages + pages_for(self.plan.floor_bytes, self.page_bytes)
        if free_pages < need:
            self.fail(f"the pool has {free_pages} free pages after the moves, the grant and the floor need {need} "
                      f"(requests admitted meanwhile took the rest); nothing was granted")
            return
        ws = state.workers[w]      # the leader's bytes: the dial resizes every rank by the same pages
        to_bytes = ws.tiers["device"].capacity_bytes - pages * ws.block_bytes
        self.owner._resize(w, to_bytes, f"tenant:{self.plan.tenant}", self.resized)

    def resized(self, out: DialOutcome) -> None:
        self.waiter.events.extend(out.events)
        if out.error is not None:
            self.fail(f"the dial did not shrink the pool to {out.to_bytes}: {out.error}")
            return
        pages = self.plan.granted_bytes // self.page_bytes
        grants = []
        for w in self.ranks:       # each rank's own share, on its own books (a worker alone: the grant)
            rid, measured = out.by_rank(w)
            grants.append(ev.TenantReclaimed(
                tenant=self.plan.tenant, worker=w, asked_bytes=self.msg.bytes,
                granted_bytes=pages * self.proc.state.workers[w].block_bytes, freed_bytes=self.freed_bytes.get(w, 0),
                measured_bytes=measured, rebind_id=rid, sessions=self.sessions,
                moves=[m for m in self.move_ids if self.move_worker.get(m, self.ranks[0]) == w]))
        self.finish(*grants)

    def fail(self, reason: str, stranded_bytes: int = 0, stranded_moves: list[str] | None = None) -> None:
        log.warning("reclaim_failed", tenant=self.plan.tenant, worker=self.msg.worker, reason=reason,
                    stranded_bytes=stranded_bytes)
        self.finish(ev.TenantReclaimFailed(tenant=self.plan.tenant, worker=self.msg.worker,
                                           asked_bytes=self.msg.bytes, reason=reason, moves=self.move_ids,
                                           stranded_bytes=stranded_bytes, stranded_moves=stranded_moves or []))

    def finish(self, *events: ev.Event) -> None:
        self.owner.busy_with = None
        for e in events:
            self.waiter.events.append((self.proc.record(e, causation=self.msg.ask_id or None), e))
        self.proc.finish_ask(self.waiter, self.ref)
