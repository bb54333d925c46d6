"""Park idle sessions: every device block of a session idle for ``park_idle_s`` goes to host. Pure.

A session whose activity time is unknown is not idle (unknown is hot). A session is parked whole
or not at all: if one of its device blocks is busy (in another move, or read by a running
request), the whole session waits for a later tick, so a session is never reported parked while
some of its pages stay on the device. The cooldown that keeps pressure from bouncing freshly
moved blocks does not hold a park back: the session's idle time is the park's own hysteresis,
and pages restored for its last turn are as idle as the rest.
"""
from __future__ import annotations

from residency.control.policy.proposals import Proposal, split_for_destination
from residency.control.policy.config import PolicyConfig
from residency.control.policy.recency import Recency
from residency.control.state import State

S = 1_000_000_000


def plan_parks(state: State, recency: Recency, busy: dict[int, set[int]], now_ns: int,
               cfg: PolicyConfig) -> list[Proposal]:
    idle_ns = int(cfg.park_idle_s * S)
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
        held_back: set[str] = set()
        for b, st in state.blocks.get(w, {}).items():
            if st.session in idle_sessions and "device" in st.tiers:
                if b in wbusy:
                    held_back.add(st.session)
                else:
                    by_session.setdefault(st.session, []).append(b)
        for session, blocks in by_session.items():
            if session in held_back:
                continue
            why = f"idle {recency.idle_ns(session, now_ns) // S} s"
            step = max(1, cfg.max_blocks_per_move)
            for i in range(0, len(blocks), step):      # one move per batch, all of them this tick
                proposals.extend(split_for_destination(state, "policy:park", "park", w, "device", "host",
                                                       blocks[i:i + step], False, session, why))
    return proposals
