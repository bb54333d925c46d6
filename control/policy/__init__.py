"""Policies: pure functions from (state, recency, time, config) to proposals.

Nothing here touches a socket, a clock or the ledger; the control process calls ``plan`` on its
tick, runs each proposal past the budget authority (``control.budget``), and records what happened.

    pressure   spill the device / demote the host above the high watermark, down to the low one
    park       park sessions idle for a while
    restore    restore on demand (the operator, the API); never held back by cooldown
    recency    last use / last move per block, last activity per session (soft, rebuilt by replay)
    memo       a refused policy proposal is not asked again unchanged (no refusal storms), and never
               retried smaller: a later, different proposal comes only from a later, different state
"""
from __future__ import annotations

from residency.control.budget import available_bytes
from residency.control.policy.proposals import Proposal, busy_blocks, leaving_bytes, release
from residency.control.policy.config import PolicyConfig
from residency.control.policy.park import plan_parks
from residency.control.policy.pressure import plan_pressure
from residency.control.policy.recency import Recency
from residency.control.policy.restore import plan_restore
from residency.control.state import State

S = 1_000_000_000


class RefusalMemo:
    """The last refusal per (origin, worker, tier): the same proposal is not repeated while the tier's
    available bytes are unchanged and the backoff has not passed."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, str], tuple[int, int]] = {}

    def note(self, proposal: Proposal, available: int, now_ns: int) -> None:
        self._last[(proposal.origin, proposal.worker, proposal.dst)] = (available, now_ns)

    def holds_back(self, state: State, proposal: Proposal, now_ns: int, backoff_ns: int) -> bool:
        last = self._last.get((proposal.origin, proposal.worker, proposal.dst))
        if last is None:
            return False
        avail_then, at = last
        avail_now = available_bytes(state.workers[proposal.worker].tiers[proposal.dst])
        return avail_now == avail_then and now_ns - at < backoff_ns


def plan(state: State, recency: Recency, now_ns: int, cfg: PolicyConfig,
         memo: RefusalMemo | None = None, busy: dict[int, set[int]] | None = None) -> list[Proposal]:
    """Every proposal the policies want now, pressure first (it protects the serving path)."""
    busy = busy_blocks(state) if busy is None else busy
    proposals: list[Proposal] = []
    if cfg.pressure:
        proposals += plan_pressure(state, recency, busy, leaving_bytes(state), now_ns, cfg)
    if cfg.park:
        taken = {(a.worker, b) for a in proposals for b in a.blocks}
        proposals += [a for a in plan_parks(state, recency, busy, now_ns, cfg)
                 if not any((a.worker, b) in taken for b in a.blocks)]
    if memo is not None:
        backoff = int(cfg.refusal_backoff_s * S)
        proposals = [a for a in proposals if a.is_release or not memo.holds_back(state, a, now_ns, backoff)]
    return proposals


__all__ = ["Proposal", "PolicyConfig", "Recency", "RefusalMemo", "plan", "plan_restore", "release",
           "busy_blocks", "leaving_bytes"]
