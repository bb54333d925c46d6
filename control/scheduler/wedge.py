"""Wedged workers: up (their I/O thread answers pings) but making no progress. Pure.

A worker's heartbeat says it is there; it does not say its engine is moving. So a serving worker
puts its progress in every Pong (its step counter, the sequences it holds, the turns of its
device thread's loop), and ``StepCompleted`` says how long each step took. From those and the
requests the control process has running on each worker:

    requests running on it, step counter still for longer than the deadline ─► WorkerWedged
    wedged, then its step counter moves, or its engine turns holding nothing ─► WorkerResumed

    deadline = max(floor, factor x the slowest step the worker reported)

A worker with nothing running is never wedged: its clock restarts whenever it has no running
request, so an idle hour does not count against the next request. Time comes in as ``now_ns``
(monotonic); nothing here reads a clock.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from residency.events import catalog as ev

MS = 1_000_000
DEFAULT_FLOOR_S = 30.0        # no deadline is shorter: a long move or a first compile stops steps too
DEFAULT_FACTOR = 8.0          # ... and none is shorter than this many of the slowest step seen


@dataclass
class _Progress:
    still_since_ns: int                   # when the step counter last moved (or nothing ran there)
    step: int | None = None               # the highest step counter heard of
    turns: int = 0                        # the device thread's loop turns, last reported
    num_held: int = 0                     # sequences the worker says it holds
    slowest_step_ns: int = 0
    wedged: ev.WorkerWedged | None = None
    wedged_at_ns: int = 0
    wedged_step: int | None = None
    wedged_turns: int = 0


class WedgeWatch:
    def __init__(self, floor_s: float = DEFAULT_FLOOR_S, factor: float = DEFAULT_FACTOR):
        if floor_s <= 0 or factor <= 0:
            raise ValueError(f"the wedge deadline needs a floor and a factor above 0, not {floor_s} and {factor}")
        self.floor_ns = int(floor_s * 1e9)
        self.factor = factor
        self._workers: dict[int, _Progress] = {}

    # ------------------------------------------------------------------ what the worker says
    def observe_pong(self, worker: int, num_steps: int | None, num_held: int, num_turns: int, now_ns: int) -> None:
        """A Pong's progress fields (``num_steps`` None: the worker serves no model; not watched)."""
        if num_steps is None:
            return
        p = self._progress(worker, now_ns)
        p.num_held, p.turns = num_held, num_turns
        self._stepped(p, num_steps, now_ns)

    def observe_step(self, worker: int, step: int, duration_ns: int, now_ns: int) -> None:
        p = self._progress(worker, now_ns)
        p.slowest_step_ns = max(p.slowest_step_ns, duration_ns)
        self._stepped(p, step, now_ns)

    def forget(self, worker: int) -> None:
        """The worker is lost: its next incarnation starts afresh."""
        self._workers.pop(worker, None)

    # ------------------------------------------------------------------ queries
    def deadline_ns(self, worker: int) -> int:
        p = self._workers.get(worker)
        slowest = p.slowest_step_ns if p is not None else 0
        return max(self.floor_ns, int(self.factor * slowest))

    def wedged(self) -> dict[int, ev.WorkerWedged]:
        """Workers wedged now, each with the event that said so."""
        return {w: p.wedged for w, p in self._workers.items() if p.wedged is not None}

    def is_wedged(self, worker: int) -> bool:
        p = self._workers.get(worker)
        return p is not None and p.wedged is not None

    # ------------------------------------------------------------------ the verdict
    def check(self, running: Mapping[int, Sequence[str]], now_ns: int) -> list[ev.Event]:
        """``running``: worker -> the requests the control process has running on it. Returns
        the WorkerWedged and WorkerResumed events to record (the watch already counts them)."""
        out: list[ev.Event] = []
        for w, p in self._workers.items():
            if p.step is None:
                continue
            if p.wedged is not None:
                moved = p.step != p.wedged_step
                idle_and_turning = p.num_held == 0 and p.turns != p.wedged_turns
                if moved or idle_and_turning:
                    out.append(ev.WorkerResumed(worker=w, step=p.step, wedged_ms=(now_ns - p.wedged_at_ns) // MS))
                    p.wedged, p.still_since_ns = None, now_ns
                continue
            ids = running.get(w, ())
            if not ids:
                p.still_since_ns = now_ns
                continue
            stalled, deadline = now_ns - p.still_since_ns, self.deadline_ns(w)
            if stalled > deadline:
                p.wedged = ev.WorkerWedged(worker=w, running=len(ids), last_step=p.step, stalled_ms=stalled // MS,
                                           deadline_ms=deadline // MS, request_ids=sorted(ids))
                p.wedged_at_ns, p.wedged_step, p.wedged_turns = now_ns, p.step, p.turns
                out.append(p.wedged)
        return out

    # ------------------------------------------------------------------ inside
    def _progress(self, worker: int, now_ns: int) -> _Progress:
        p = self._workers.get(worker)
        if p is None:
            p = self._workers[worker] = _Progress(still_since_ns=now_ns)
        return p

    @staticmethod
    def _stepped(p: _Progress, step: int, now_ns: int) -> None:
        # a Pong and a StepCompleted come on two sockets, in either order: only a higher count moves
        if p.step is None or step > p.step:
            p.step, p.still_since_ns = step, now_ns
