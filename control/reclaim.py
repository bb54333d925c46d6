"""The reclaim planner: which pool slots to empty, and by how much to shrink the device pool, for
an outside tenant's ask, or the refusal with its arithmetic. Pure: values in, a plan or a
refusal out; the loop thread (control/scheduler/reclaimer.py) builds the candidates and runs the plan.

    capacity ─┬─────────────────────────┐
              │ granted (the ask, whole │  the pool shrinks by this, through the dial
              │ pages)                  │
    new cap ──┼─────────────────────────┤
              │ floor (stays free)      │  BudgetSet.floor_bytes of the device tier
              ├─────────────────────────┤
              │ pages that stay         │
    0 ────────┴─────────────────────────┘

    pages to empty = granted pages + floor pages - free pages   (none when already free)
    available      = free + reclaimable by the tenant's routes - floor
    granted > available: refused whole, before anything moves; never retried smaller.
    new cap < context floor (one sequence of the whole context): refused whole the same way.

Reclaimable counts a page once, under the first route of the tenant's order that can take it; a
page whose copy must land on host counts only while the host has room for it (the same order).
"""
from __future__ import annotations

import msgspec

from residency.events import catalog as ev

WHOLE_ROUTES = ("prefixes", "park")      # a session goes whole; evict goes page by page


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """Idle device pages one route could empty: a whole session (prefixes, park), or one page (evict).
    ``to_copy``: how many of them have no host copy yet (a park or evict must copy those)."""

    route: str
    session: str | None
    pages: tuple[int, ...]
    to_copy: int = 0


class Pool(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's device pool as the next admission sees it."""

    worker: int
    block_bytes: int
    capacity_bytes: int
    free_pages: int                   # free slots less those running requests reserved
    floor_bytes: int = 0
    host_room_bytes: int = 0          # what moves may still bring into the host tier
    context_pages: int = 0            # the pool keeps one sequence of the whole context (control/dial.py)


class Step(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    session: str | None
    pages: tuple[int, ...]


class ReclaimPlan(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    worker: int
    asked_bytes: int                  # as asked
    granted_bytes: int                # the ask in whole pages: what the pool gives up
    to_bytes: int                     # the pool's capacity afterwards
    pages_to_empty: int
    steps: tuple[Step, ...]
    free_bytes: int
    reclaimable_bytes: dict[str, int]
    available_bytes: int
    floor_bytes: int


class ReclaimRefused(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    worker: int
    asked_bytes: int
    granted_bytes: int
    available_bytes: int
    floor_bytes: int
    free_bytes: int
    reclaimable_bytes: dict[str, int]
    reason: str

    def event(self) -> ev.MoveRefused:
        """Recorded as a MoveRefused whose ask is ``tenant:<name>``, so every reader of refusals
        (diagnose, audit) sees it with the others."""
        return ev.MoveRefused(ask=f"tenant:{self.tenant}", worker=self.worker, tier="device",
                              asked_bytes=self.granted_bytes, available_bytes=self.available_bytes,
                              floor_bytes=self.floor_bytes, reason=self.reason)


def pages_for(nbytes: int, block_bytes: int) -> int:
    """Whole pages that hold ``nbytes`` (rounded up)."""
    return -(-nbytes // block_bytes)


def _countable(pool: Pool, routes: tuple[str, ...], candidates: list[Candidate]):
    """The candidates the tenant's routes can use, in order, each page once, host room spent in
    the same order; and the reclaimable bytes by route."""
    seen: set[int] = set()
    room = pool.host_room_bytes
    by_route = {r: 0 for r in routes}
    usable: list[Candidate] = []
    for route in routes:
        for c in candidates:
            if c.route != route:
                continue
            pages = tuple(p for p in c.pages if p not in seen)
            if not pages:
                continue
            # the copies still needed shrink with the pages an earlier route already took
            copy_bytes = min(c.to_copy, len(pages)) * pool.block_bytes
            if copy_bytes > room:
                continue
            room -= copy_bytes
            seen.update(pages)
            by_route[route] += len(pages) * pool.block_bytes
            usable.append(Step(route=route, session=c.session, pages=pages))
    return usable, by_route


def plan_reclaim(tenant: str, routes: tuple[str, ...], pool: Pool, candidates: list[Candidate],
                 asked_bytes: int) -> ReclaimPlan | ReclaimRefused:
    """The steps that empty enough slots for a pool ``asked_bytes`` (rounded up to whole pages)
    smaller with the floor still free, or the refusal with its arithmetic. ``asked_bytes`` must be
    > 0 (the caller refuses the rest by name)."""
    if asked_bytes <= 0:
        raise ValueError(f"asked_bytes must be > 0, not {asked_bytes}")
    bb = pool.block_bytes
    granted_pages = pages_for(asked_bytes, bb)
    granted = granted_pages * bb
    floor_pages = pages_for(pool.floor_bytes, bb)
    usable, by_route = _countable(pool, routes, candidates)
    free = max(0, pool.free_pages) * bb
    reclaimable = sum(by_route.values())
    available = max(0, free + reclaimable - pool.floor_bytes)
    keep = pool.context_pages * bb
    cap = max(0, pool.capacity_bytes - max(pool.floor_bytes, keep))
    if granted > available or granted > cap:
        avail = min(available, cap)
        parts = ", ".join(f"{r} {b}" for r, b in by_route.items())
        reason = (f"asked {granted} ({granted_pages} pages of {bb}) > available {avail} = free {free} + reclaimable "
                  f"{reclaimable} ({parts}) - floor {pool.floor_bytes}")
        if avail < available and keep > pool.floor_bytes:
            reason += (f", capped by capacity {pool.capacity_bytes} - context floor {keep} ({pool.context_pages} "
                       f"pages: one sequence of the whole context)")
        elif avail < available:
            reason += f", capped by capacity {pool.capacity_bytes} - floor"
        return ReclaimRefused(tenant=tenant, worker=pool.worker, asked_bytes=asked_bytes, granted_bytes=granted,
                              available_bytes=avail, floor_bytes=pool.floor_bytes, free_bytes=free,
                              reclaimable_bytes=by_route, reason=reason)
    need = max(0, granted_pages + floor_pages - max(0, pool.free_pages))
    steps: list[Step] = []
    taken = 0
    for s in usable:
        if taken >= need:
            break
        steps.append(s)
        taken += len(s.pages)
    return ReclaimPlan(tenant=tenant, worker=pool.worker, asked_bytes=asked_bytes, granted_bytes=granted,
                       to_bytes=pool.capacity_bytes - granted, pages_to_empty=need, steps=tuple(steps),
                       free_bytes=free, reclaimable_bytes=by_route, available_bytes=available,
                       floor_bytes=pool.floor_bytes)
