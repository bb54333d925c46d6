"""Thresholds of the detectors, in one place, with defaults an operator can reason about."""
from __future__ import annotations

import msgspec

SECOND = 1_000_000_000


class DiagnoseParams(msgspec.Struct, frozen=True, kw_only=True):
    # stall: requests waiting and no forward step and no completed move for this long
    stall_after_ns: int = 10 * SECOND
    # overdue moves: an ack this far past the deadline that the watchdog never stranded is a finding
    late_grace_ns: int = 1 * SECOND
    # pendulum: a block leaving the device and coming back this many times within the window
    pendulum_round_trips: int = 3
    pendulum_window_ns: int = 60 * SECOND
    # refusal storm: the same ask refused this many times within the window; storms of one caller
    # closer than the merge gap are one episode
    storm_refusals: int = 3
    storm_window_ns: int = 2 * SECOND
    storm_merge_gap_ns: int = 30 * SECOND
    # retried smaller: a smaller ask for the same thing this soon after a refusal
    retry_window_ns: int = 30 * SECOND
    # rebind: readers still on different generations this long after the rebind was requested
    rebind_timeout_ns: int = 5 * SECOND
    # hole: device bytes freed while requests wait, and nothing allocated on that device for this long
    hole_after_ns: int = 5 * SECOND
    # groups: explicit membership {"tp0": [0, 1]}; empty = workers that ever agreed on a step digest
    groups: dict[str, list[int]] = {}
    # budget episodes (pinned over budget, device under floor) closer than this are one episode
    merge_gap_ns: int = 5 * SECOND
    # a worker's heartbeat reported missing, with no sign of life since, for this long
    silent_after_ns: int = 0
    # queued: requests waiting for room, the oldest of them for this long
    queued_after_ns: int = 5 * SECOND
    # tier_full: every ask into a tier refused over at least this long (a budget that never moves)
    tier_full_after_ns: int = 10 * SECOND
    # expert thrash: one expert of an offloaded MoE model fetched and evicted this many times within the window
    expert_thrash_cycles: int = 3
    expert_thrash_window_ns: int = 30 * SECOND
