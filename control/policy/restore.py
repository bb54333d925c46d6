"""Restore on demand: bring a session's (or the named) blocks back to the device. Pure.

Each block comes from the fastest tier holding a copy (host before disk), one move per source
tier. Cooldown never holds back a restore someone is waiting for.
"""
from __future__ import annotations

from residency.control.policy.proposals import RESTORE_SOURCES, Proposal
from residency.control.state import State, copies_on


def plan_restore(state: State, origin: str, worker: int, blocks, session: str | None, keep_source: bool = False,
                 src: str | None = None, block_set: set[int] | None = None) -> list[Proposal]:
    """``block_set``: ``blocks`` as a set, when the caller has made it (set-to-set tests are cheaper)."""
    wb = state.blocks.get(worker, {})
    ids = blocks if block_set is None else block_set
    sources = RESTORE_SOURCES if src is None else (src,)
    # The usual restore: every block off the device with a copy on the first source. The state's
    # copy index says so by set algebra (control/moves.py's _split does the same).
    if (blocks and copies_on(state, worker, sources[0]).issuperset(ids)
            and copies_on(state, worker, "device").isdisjoint(ids)):
        return [Proposal(origin=origin, kind="restore", worker=worker, src=sources[0], dst="device",
                         blocks=tuple(blocks), keep_source=keep_source, session=session, reason="demand")]
    # NOTE: one plain loop, no generator or call per block: a 2 GiB restore names 1024 blocks and
    # this runs on the control loop between the proposal and the command.
    by_src: dict[str, list[int]] = {s: [] for s in sources}
    if len(sources) == 2:
        first, second = sources
        to_first, to_second = by_src[first], by_src[second]
        for b in blocks:
            tiers = wb[b].tiers
            if "device" in tiers:
                continue
            if first in tiers:
                to_first.append(b)
            elif second in tiers:
                to_second.append(b)
        if to_first and to_second and blocks.index(to_second[0]) < blocks.index(to_first[0]):
            by_src = {second: to_second, first: to_first}     # one move per source, in order of first use
    else:
        by_src = {}
        for b in blocks:
            tiers = wb[b].tiers
            if "device" in tiers:
                continue
            for s in sources:
                if s in tiers:
                    by_src.setdefault(s, []).append(b)
                    break
    return [Proposal(origin=origin, kind="restore", worker=worker, src=s, dst="device", blocks=tuple(bl),
                     keep_source=keep_source, session=session, reason="demand")
            for s, bl in by_src.items() if bl]
