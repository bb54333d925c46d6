"""Diagnose a ledger: detectors that find wedges, stalls and broken budgets in the event stream.

Each detector is a pure function of the stream and a point in time::

    findings = detect_overdue_moves(events, at_ns=..., params=DiagnoseParams())

and ``diagnose(events, at_ns)`` runs all of them in one pass (a million events in seconds).

    detector            finds                                                     module
    overdue_move        a move in flight past its deadline, and what waits on it;  moves
                        strandings unresolved, acks the watchdog never stranded
    stall               requests waiting, no step and no acked move for T          stall
    hole                device bytes freed while requests wait, left unclaimed     stall
    worker              a worker silent or lost, with the bytes stranded on it     workers
    pendulum            the same blocks off the device and back, again and again   moves
    refusal_storm       the same ask refused again and again                       refusals
    retried_smaller     a refused ask retried smaller                              refusals
    torn_rebind         readers left on different pool generations                 rebind
    pinned_over_budget  pinned host bytes over budget; pin counts gone negative    budgets
    device_below_floor  device free bytes under the budget's floor                 budgets
    group_divergence    ranks of a group whose step digests differ                 groups
    wedged_worker       pings answered, no engine step while requests run          wedged
    queued              requests waiting for room, and why none comes              waiting
    tier_full           a tier refusing every ask, none funded, for T              waiting
    crash               a start with no stop before it: adoption, orphans closed   crash
    expert_thrash       an offloaded MoE expert fetched and evicted again and      experts
                        again within a window
"""
from __future__ import annotations

from typing import Iterable

from residency.events import Recorded
from residency.control.diagnose.budgets import DeviceBelowFloor, PinnedOverBudget
from residency.control.diagnose.crash import Crash
from residency.control.diagnose.experts import ExpertThrash
from residency.control.diagnose.scan import Diagnosis, detect_with, diagnose, run_pass
from residency.control.diagnose.findings import Finding, fmt_bytes, fmt_duration, sort_findings
from residency.control.diagnose.groups import GroupDivergence
from residency.control.diagnose.moves import OverdueMoves, Pendulum
from residency.control.diagnose.params import DiagnoseParams
from residency.control.diagnose.rebind import TornRebind
from residency.control.diagnose.refusals import RefusalStorm, RetriedSmaller
from residency.control.diagnose.stall import Hole, Stall
from residency.control.diagnose.wedged import WedgedWorker
from residency.control.diagnose.waiting import Queued, TierFull
from residency.control.diagnose.workers import WorkerSilence

ALL_DETECTORS = (
    OverdueMoves, Stall, WorkerSilence, Pendulum, RefusalStorm, RetriedSmaller,
    TornRebind, PinnedOverBudget, DeviceBelowFloor, Hole, GroupDivergence, WedgedWorker, Queued, TierFull, Crash,
    ExpertThrash,
)

_Events = Iterable[Recorded]


def detect_overdue_moves(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(OverdueMoves, events, at_ns, params)


def detect_stalls(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(Stall, events, at_ns, params)


def detect_worker_silence(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(WorkerSilence, events, at_ns, params)


def detect_pendulum(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(Pendulum, events, at_ns, params)


def detect_refusal_storms(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(RefusalStorm, events, at_ns, params)


def detect_retried_smaller(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(RetriedSmaller, events, at_ns, params)


def detect_torn_rebinds(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(TornRebind, events, at_ns, params)


def detect_pinned_over_budget(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(PinnedOverBudget, events, at_ns, params)


def detect_device_below_floor(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(DeviceBelowFloor, events, at_ns, params)


def detect_holes(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(Hole, events, at_ns, params)


def detect_group_divergence(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(GroupDivergence, events, at_ns, params)


def detect_wedged_workers(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(WedgedWorker, events, at_ns, params)


def detect_queued(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(Queued, events, at_ns, params)


def detect_tier_full(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(TierFull, events, at_ns, params)


def detect_expert_thrash(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(ExpertThrash, events, at_ns, params)


def detect_crashes(events: _Events, at_ns: int, params: DiagnoseParams | None = None) -> list[Finding]:
    return detect_with(Crash, events, at_ns, params)


__all__ = [
    "ALL_DETECTORS", "DiagnoseParams", "Diagnosis", "Finding", "diagnose", "run_pass", "sort_findings",
    "fmt_bytes", "fmt_duration",
    "detect_overdue_moves", "detect_stalls", "detect_worker_silence", "detect_pendulum",
    "detect_refusal_storms", "detect_retried_smaller", "detect_torn_rebinds",
    "detect_pinned_over_budget", "detect_device_below_floor", "detect_holes", "detect_group_divergence",
    "detect_wedged_workers",
    "detect_queued", "detect_tier_full", "detect_crashes", "detect_expert_thrash",
]
