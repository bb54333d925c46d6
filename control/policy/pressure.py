"""Spill under pressure, with watermarks. Pure.

    limit ─────────── ceiling (or capacity)
    high  ─ ─ ─ ─ ─── above this, plan moves out ...
    low   ─ ─ ─ ─ ─── ... until the tier would be back here
          occupied = used + in flight toward the tier - bytes in-flight moves will free there

Device pressure evicts device→host; host pressure demotes host→disk. Candidates are the coldest
blocks (by last use) that are neither hot, nor cooling, nor busy in another move; a block that
already has a copy on the destination is simply released from the source. The gap between the
watermarks is the hysteresis that keeps one busy tier from moving a block per tick.
"""
from __future__ import annotations

from residency.control.budget import limit_bytes
from residency.control.policy.proposals import Proposal, split_for_destination
from residency.control.policy.config import PolicyConfig
from residency.control.policy.recency import Recency
from residency.control.state import State

S = 1_000_000_000
RELIEF: tuple[tuple[str, str, str], ...] = (("device", "host", "evict"), ("host", "disk", "demote"))


def plan_pressure(state: State, recency: Recency, busy: dict[int, set[int]],
                  leaving: dict[tuple[int, str], int], now_ns: int, cfg: PolicyConfig) -> list[Proposal]:
    proposals: list[Proposal] = []
    hot_ns, cool_ns = int(cfg.hot_s * S), int(cfg.cooldown_s * S)
    for w, ws in state.workers.items():
        if not ws.alive or ws.block_bytes <= 0:
            continue
        for tier, dst, kind in RELIEF:
            acc = ws.tiers[tier]
            limit = limit_bytes(acc)
            if limit == 0 or ws.tiers[dst].capacity_bytes == 0:
                continue
            occupied = acc.used_bytes + acc.inflight_in_bytes - leaving.get((w, tier), 0)
            if occupied <= cfg.high_watermark * limit:
                continue
            need_blocks = -(-(occupied - int(cfg.low_watermark * limit)) // ws.block_bytes)
            wbusy = busy.get(w, ())
            cands = [b for b, st in state.blocks.get(w, {}).items()
                     if tier in st.tiers and b not in wbusy
                     and not recency.is_hot(w, b, now_ns, hot_ns)
                     and not recency.is_cooling(w, b, now_ns, cool_ns)]
            if not cands:
                continue
            cands.sort(key=lambda b: recency.last_used(w, b))
            chosen = cands[:min(need_blocks, cfg.max_blocks_per_move)]
            reason = f"pressure: {tier} at {occupied} of limit {limit} > high {cfg.high_watermark:.2f}"
            proposals.extend(split_for_destination(state, "policy:pressure", kind, w, tier, dst, chosen,
                                                   False, None, reason))
    return proposals
