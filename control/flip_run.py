"""A flip, sleep or wake in progress (the Flipper's state of one run; control/flipping.py)."""
from __future__ import annotations

from residency.events import catalog as ev
from residency.events.commands import WeightsSwapped
from residency.control import flip, moves


class Run:
    """A flip, sleep or wake in progress on one worker, or on every rank of a group (``ranks``,
    leader first: ``worker`` is the leader, whose requests, sessions and pool it drains, parks and
    resizes; each rank has its own plan, FlipRequested and answer)."""

    __slots__ = ("worker", "plan", "origin", "waiter", "ref", "phase", "since_ns", "parks", "req", "at_stake",
                 "causation", "ranks", "plans", "reqs", "answers", "stakes")

    def __init__(self, plan: flip.FlipPlan, origin: str, waiter: moves.AskWaiter, ref: str, now_ns: int,
                 causation: str | None, plans: list[flip.FlipPlan] | None = None):
        self.worker, self.plan, self.origin, self.waiter, self.ref = plan.worker, plan, origin, waiter, ref
        self.plans = {p.worker: p for p in (plans or [plan])}
        self.ranks = list(self.plans)
        self.reqs: dict[int, ev.FlipRequested] = {}          # rank's worker -> its FlipRequested
        self.answers: dict[int, WeightsSwapped] = {}         # rank's worker -> its WeightsSwapped
        self.stakes: dict[int, int] = {}                     # rank's worker -> its arena bytes at stake
        self.phase = "draining"       # draining | parking | shrinking | swapping | growing
        self.since_ns = now_ns
        self.parks: set[str] = set()  # sessions whose park is still unanswered
        self.req: ev.FlipRequested | None = None
        self.at_stake = 0
        self.causation = causation


def running_reason(run: Run) -> tuple[str, str]:
    what = run.plan.action
    to = f" to {run.plan.to_model!r}" if what == "flip" else ""
    if run.req is not None:
        return ("flip_in_progress", f"worker {run.worker} is running {what} {run.req.flip_id}{to}")
    return ("flip_in_progress", f"worker {run.worker} is getting ready to {what}{to} ({run.phase})")


__all__ = ["Run", "running_reason"]
