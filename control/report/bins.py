"""Downsampling: a million change points become a few hundred bins per series.

A step function is binned honestly: each bin keeps the lowest and highest value it held and the
value it ended on, so a spike or a dip shorter than a bin still shows in the band.

    edges:  |  bin 0  |  bin 1  |  bin 2  |
    ts:        ^   ^                ^
    a bin's values = the value carried in at its left edge + every change inside it
"""
from __future__ import annotations

import numpy as np

from residency.control.report.collect import Changes, Times


def make_edges(t0: int, t1: int, num_bins: int) -> np.ndarray:
    if t1 <= t0:
        t1 = t0 + 1
    return np.linspace(t0, t1, num_bins + 1).astype(np.int64)


def step_bins(ch: Changes, edges: np.ndarray, initial: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low, high, last) per bin of the step function ``ch``."""
    nb = len(edges) - 1
    ts = np.frombuffer(ch.ts, dtype=np.int64)
    vals = np.frombuffer(ch.vals, dtype=np.int64)
    if len(ts) == 0:
        z = np.full(nb, initial, dtype=np.int64)
        return z, z.copy(), z.copy()
    order = None
    if np.any(ts[1:] < ts[:-1]):          # producers' clocks may step back a little; keep ledger order stable
        order = np.argsort(ts, kind="stable")
        ts, vals = ts[order], vals[order]
    start_idx = np.searchsorted(ts, edges[:-1], side="right") - 1
    end_idx = np.searchsorted(ts, edges[1:], side="right") - 1
    carried = np.where(start_idx >= 0, vals[np.maximum(start_idx, 0)], initial)
    last = np.where(end_idx >= 0, vals[np.maximum(end_idx, 0)], initial)
    # a change inside bin i is one with edges[i] < t <= edges[i+1]; one exactly on edges[i] is carried in
    inside = (ts > edges[0]) & (ts <= edges[-1])
    b = np.clip(np.searchsorted(edges, ts[inside], side="left") - 1, 0, nb - 1)
    low, high = carried.copy(), carried.copy()
    np.minimum.at(low, b, vals[inside])
    np.maximum.at(high, b, vals[inside])
    return low, high, last


def count_bins(t: Times, edges: np.ndarray) -> np.ndarray:
    ts = np.frombuffer(t.ts, dtype=np.int64)
    counts, _ = np.histogram(ts, bins=edges)
    return counts.astype(np.int64)
