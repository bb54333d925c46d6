"""Restore on demand: bring a session's (or the named) blocks back to the device. Pure.

Each block comes from the fastest tier holding a copy (host before disk), one move per source
tier. Cooldown never holds back a restore someone is waiting for.
"""
from __future__ import annotations

from control.policy.asks import RESTORE_SOURCES, Ask
from control.state import State


def plan_restore(state: State, asker: str, worker: int, blocks, session: str | None,
                 keep_source: bool = False, src: str | None = None) -> list[Ask]:
    wb = state.blocks.get(worker, {})
    by_src: dict[str, list[int]] = {}
    for b in blocks:
        st = wb[b]
        if "device" in st.tiers:
            continue
        source = src if src is not None else next((t for t in RESTORE_SOURCES if t in st.tiers), None)
        if source is None or source not in st.tiers:
            continue
        by_src.setdefault(source, []).append(b)
    return [Ask(asker=asker, kind="restore", worker=worker, src=s, dst="device", blocks=tuple(bl),
                keep_source=keep_source, session=session, reason="demand")
            for s, bl in by_src.items()]
