"""The budget authority: one per (worker, tier), with a floor and a ceiling. Pure.

    capacity ──┬── the tier's size, as the worker reported it (WorkerJoined)
    ceiling  ──┤   BudgetSet.ceiling_bytes (0 = capacity): the most the tier may hold
               │ ▲
               │ │ floor_bytes: headroom a move may not take (the serving path's reserve,
               │ ▼             so a restore cannot starve the decode that needs the next page)
    fundable ──┤   a move into the tier is funded only up to ceiling - floor
               │   used + in flight toward the tier
    0 ─────────┘

``can_fund`` answers with ``None`` (funded) or a ``Refusal`` that carries the arithmetic. A refusal
changes nothing; the caller records it (``MoveRefused``) and stops. Nobody retries it smaller
behind the asker's back: the asker gets the refusal and decides.
"""
from __future__ import annotations

import msgspec

from residency.events import catalog as ev
from residency.control.state import State, TierAccount


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    worker: int
    tier: str
    asked_bytes: int
    available_bytes: int
    floor_bytes: int
    ceiling_bytes: int
    used_bytes: int
    inflight_bytes: int
    reason: str

    def event(self, origin: str, session: str | None = None) -> ev.MoveRefused:
        return ev.MoveRefused(ask=origin, worker=self.worker, tier=self.tier, asked_bytes=self.asked_bytes,
                              available_bytes=self.available_bytes, floor_bytes=self.floor_bytes,
                              reason=self.reason, session=session)


def limit_bytes(acc: TierAccount) -> int:
    """The most the tier may hold: the ceiling when one is set, never above capacity."""
    if acc.ceiling_bytes and acc.ceiling_bytes < acc.capacity_bytes:
        return acc.ceiling_bytes
    return acc.capacity_bytes


def available_bytes(acc: TierAccount, reserved_bytes: int = 0) -> int:
    """Bytes a move may still bring into the tier (never negative)."""
    return max(0, limit_bytes(acc) - acc.floor_bytes - acc.used_bytes - acc.inflight_in_bytes - reserved_bytes)


def stranded_toward(state: State, answered: frozenset[str] | set[str] = frozenset()) -> dict[tuple[int, str], int]:
    """Bytes of stranded moves that may still land, per (worker, destination tier).

    NOTE: a stranded move is no longer "in flight" for the fold, but its copy may still arrive (a late
    ack adds it). Until its worker has answered for it (``answered``: it failed, or never ran), its
    destination bytes stay reserved, or a late ack could take a tier past its capacity.
    """
    out: dict[tuple[int, str], int] = {}
    for mid, mv in state.stranded.items():
        if mv.src != mv.dst and mid not in answered:
            key = (mv.worker, mv.dst)
            out[key] = out.get(key, 0) + mv.bytes_planned
    return out


def can_fund(state: State, worker: int, tier: str, asked_bytes: int, reserved_bytes: int = 0) -> Refusal | None:
    """``None`` when a move of ``asked_bytes`` into ``tier`` of ``worker`` fits its budget;
    ``reserved_bytes``: room held for stranded moves that may still land there."""
    ws = state.workers[worker]
    acc = ws.tiers[tier]
    avail = available_bytes(acc, reserved_bytes)
    if asked_bytes <= avail:
        return None
    limit = limit_bytes(acc)
    if acc.capacity_bytes == 0:
        reason = f"{tier} of worker {worker} has no capacity"
    else:
        reason = (f"asked {asked_bytes} > available {avail} = limit {limit} - floor {acc.floor_bytes}"
                  f" - used {acc.used_bytes} - in flight {acc.inflight_in_bytes}"
                  + (f" - held for stranded moves {reserved_bytes}" if reserved_bytes else ""))
    return Refusal(worker=worker, tier=tier, asked_bytes=asked_bytes, available_bytes=avail,
                   floor_bytes=acc.floor_bytes, ceiling_bytes=limit, used_bytes=acc.used_bytes,
                   inflight_bytes=acc.inflight_in_bytes, reason=reason)


def check_budget(state: State, worker: int, tier: str, floor_bytes: int, ceiling_bytes: int) -> str | None:
    """Why a BudgetSet would be nonsense (``None`` when it is fine). A ceiling below what the tier
    holds now is allowed: that is how an operator asks the pressure policy to spill."""
    ws = state.workers.get(worker)
    if ws is None:
        return f"no worker {worker}"
    if tier not in ws.tiers:
        return f"no tier {tier!r}"
    cap = ws.tiers[tier].capacity_bytes
    if floor_bytes < 0 or ceiling_bytes < 0:
        return f"floor {floor_bytes} and ceiling {ceiling_bytes} must be >= 0"
    if ceiling_bytes > cap:
        return f"ceiling {ceiling_bytes} > capacity {cap} of {tier} on worker {worker}"
    if floor_bytes > (ceiling_bytes or cap):
        return f"floor {floor_bytes} > ceiling {ceiling_bytes or cap}"
    return None
