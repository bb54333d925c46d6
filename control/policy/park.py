"""Park idle sessions: every device block of a session idle for ``park_idle_s`` goes to host. Pure.

A session whose activity time is unknown is not idle (unknown is hot). Blocks busy in another move
or cooling are left for a later tick; the rest of the session is parked now.
"""
from __future__ import annotations

from residency.control.policy.proposals import Proposal, split_for_destination
from residency.control.policy.config import PolicyConfig
from residency.control.policy.recency import Recency
from residency.control.state import State

S = 1_000_000_000


def plan_parks(state: State, recency: Recency, busy: dict[int, set[int]], now_ns: int,
               cfg: PolicyConfig) -> list[Proposal]:
    idle_ns, cool_ns = int(cfg.park_idle_s * S), int(cfg.cooldown_s * S)
    idle_sessions = {s for s in state.sessions
                     if (i := recency.idle_ns(s, now_ns)) is not None and i >= idle_ns}
    if not idle_sessions:
        return []
    proposals: list[Proposal] = []
    for w, ws in state.workers.items():
        if not ws.alive or ws.tiers["host"].capacity_bytes == 0:
            continue
        wbusy = busy.get(w, ())
        by_session: dict[str, list[int]] = {}
        for b, st in state.blocks.get(w, {}).items():
            if (st.session in idle_sessions and "device" in st.tiers and b not in wbusy
                    and not recency.is_cooling(w, b, now_ns, cool_ns)):
                by_session.setdefault(st.session, []).append(b)
        for session, blocks in by_session.items():
            blocks = blocks[:cfg.max_blocks_per_move]
            proposals.extend(split_for_destination(state, "policy:park", "park", w, "device", "host", blocks,
                                                   False, session, f"idle {recency.idle_ns(session, now_ns) // S} s"))
    return proposals
