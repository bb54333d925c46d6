"""Inline SVG charts, drawn by hand: no library, no network, a few kilobytes each.

Every chart shares one time axis (same left margin and width), so an operator can read down the
page at one instant. Paths use H/V steps: a bin is a flat segment, which is what a binned
series is, and it keeps the file small.

    0 ──────── LEFT ─────────────────────────── LEFT+PW ── W
    │  labels  │ plot area (x = time)             │
"""
from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from typing import Sequence

import msgspec
import numpy as np

W = 1160
LEFT = 132
RIGHT = 14
PW = W - LEFT - RIGHT
TOP = 8
BOTTOM = 22

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")
SEVERITY_COLOR = {"critical": "#d62728", "warning": "#f0a202", "info": "#7f9fbf"}

_TIME_STEPS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600,
                 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def fmt_value(v: float, kind: str) -> str:
    if kind == "bytes":
        for unit, size in _UNITS:
            if abs(v) >= size or size == 1:
                return f"{v / size:.4g} {unit}"
    return f"{v:.4g}"


class TimeAxis:
    def __init__(self, t0: int, t1: int) -> None:
        self.t0, self.t1 = t0, max(t1, t0 + 1)

    def x(self, t: int | float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * PW

    def ticks(self, max_ticks: int = 9) -> list[tuple[float, str]]:
        span_s = (self.t1 - self.t0) / 1e9
        step = next((s for s in _TIME_STEPS_S if span_s / s <= max_ticks), _TIME_STEPS_S[-1])
        step_ns = int(step * 1e9)
        first = -(-self.t0 // step_ns) * step_ns
        out = []
        for t in range(first, self.t1 + 1, step_ns):
            dt = datetime.fromtimestamp(t / 1e9, tz=timezone.utc)
            if span_s > 2 * 86400:
                label = dt.strftime("%m-%d %H:%M")
            elif step < 1:
                label = dt.strftime("%H:%M:%S.") + f"{(t // 1_000_000) % 1000:03d}"
            else:
                label = dt.strftime("%H:%M:%S")
            out.append((self.x(t), label))
        return out


def nice_ticks(vmax: float, kind: str, n: int = 4) -> tuple[float, list[tuple[float, str]]]:
    """A rounded top for the axis and 3-5 labelled ticks (bytes in binary units)."""
    if vmax <= 0:
        vmax = 1
    unit_name, unit = ("", 1)
    if kind == "bytes":
        unit_name, unit = next(((u, s) for u, s in _UNITS if vmax >= s), ("B", 1))
    scaled = vmax / unit
    raw = scaled / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if kind == "count":
        step = max(step, 1)
    top = math.ceil(scaled / step) * step
    ticks = []
    v = 0.0
    while v <= top + 1e-9:
        label = f"{v:g}" + (f" {unit_name}" if unit_name and v else "")
        ticks.append((v * unit, label))
        v += step
    return top * unit, ticks


def _y(v: np.ndarray | float, top: float, h: float):
    return TOP + (h - TOP - BOTTOM) * (1 - np.asarray(v, dtype=np.float64) / top)


def _steps(xs: np.ndarray, ys: np.ndarray) -> str:
    """'H x1 V y1 H x2 ...' for a step function whose bin i spans xs[i]..xs[i+1] at ys[i]."""
    parts = []
    prev = None
    for i, y in enumerate(ys):
        if prev is None or y != prev:
            parts.append(f"V{y:.1f}")
            prev = y
        parts.append(f"H{xs[i + 1]:.1f}")
    # merge consecutive H commands: keep only the last of each run
    out = []
    for p in parts:
        if p[0] == "H" and out and out[-1][0] == "H":
            out[-1] = p
        else:
            out.append(p)
    return "".join(out)


def step_path(xs: np.ndarray, ys: np.ndarray) -> str:
    return f"M{xs[0]:.1f},{ys[0]:.1f}" + _steps(xs, ys)


def band_path(xs: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> str:
    """A closed region between two step functions: along ``hi`` forward, back along ``lo``."""
    fwd = f"M{xs[0]:.1f},{hi[0]:.1f}" + _steps(xs, hi)
    back = []
    for i in range(len(lo) - 1, -1, -1):
        back.append(f"V{lo[i]:.1f}H{xs[i]:.1f}")
    return fwd + "".join(back) + "Z"


class Series(msgspec.Struct, kw_only=True):
    name: str
    values: list[float]                 # per bin (the value the bin ended on, or its count)
    color: str
    low: list[float] | None = None      # per-bin band for step functions
    high: list[float] | None = None
    dashed: bool = False
    # a reference level (a capacity): drawn over the data's scale, never setting it alone
    reference: bool = False


class Marker(msgspec.Struct, kw_only=True):
    t_ns: int
    color: str
    label: str


def _peak(s: Series) -> float:
    return max(s.high or s.values, default=0)


def chart(chart_id: str, title: str, subtitle: str, axis: TimeAxis, edges: np.ndarray, series: Sequence[Series],
          kind: str, *, stacked: bool = False, height: int = 170, markers: Sequence[Marker] = ()) -> str:
    """A chart with a time axis; ``stacked`` draws areas on top of each other (counts per bin)."""
    xs = np.array([axis.x(t) for t in edges])
    if stacked:
        cum = np.cumsum(np.array([s.values for s in series], dtype=np.float64), axis=0) if series else np.zeros((1, 1))
        vmax = float(cum[-1].max()) if series else 1.0
    else:
        vmax = max([_peak(s) for s in series if not s.reference] + [0])
        # NOTE: a capacity of GiB over a use of MiB, put on the scale, would draw the use as a flat
        # line at zero. A reference joins the scale only while the data still fill half of it.
        vmax = max([_peak(s) for s in series if s.reference and _peak(s) <= 2 * vmax] + [vmax])
    top, yticks = nice_ticks(vmax, kind)
    off_scale = {id(s) for s in series if s.reference and _peak(s) > top}
    parts = [f'<svg class="plot" data-chart="{esc(chart_id)}" viewBox="0 0 {W} {height}" '
             f'role="img" aria-label="{esc(title)}">']
    for v, label in yticks:
        y = float(_y(v, top, height))
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + PW}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="ylab" x="{LEFT - 6}" y="{y + 4:.1f}">{esc(label)}</text>')
    for x, label in axis.ticks():
        parts.append(f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{height - BOTTOM}" y2="{height - BOTTOM + 4}"/>'
                     f'<text class="xlab" x="{x:.1f}" y="{height - 6}">{esc(label)}</text>')
    for m in markers:
        x = axis.x(m.t_ns)
        parts.append(f'<line class="marker" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{height - BOTTOM}" '
                     f'stroke="{m.color}"><title>{esc(m.label)}</title></line>')
    if stacked and series:
        below = np.full(len(xs) - 1, float(_y(0, top, height)))
        for s, c in zip(series, cum):
            ys = _y(c, top, height)
            parts.append(f'<path class="area" fill="{s.color}" d="{band_path(xs, below, ys)}"><title>{esc(s.name)}</title></path>')
            below = ys
    else:
        for s in series:
            if id(s) in off_scale:
                continue
            if s.low is not None and s.high is not None:
                parts.append(f'<path class="band" fill="{s.color}" '
                             f'd="{band_path(xs, _y(s.low, top, height), _y(s.high, top, height))}"/>')
            dash = ' stroke-dasharray="5 4"' if s.dashed else ""
            parts.append(f'<path class="line" stroke="{s.color}"{dash} d="{step_path(xs, _y(s.values, top, height))}">'
                         f'<title>{esc(s.name)}</title></path>')
    parts.append(f'<line class="axis" x1="{LEFT}" x2="{LEFT + PW}" y1="{height - BOTTOM}" y2="{height - BOTTOM}"/>')
    parts.append(f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{height - BOTTOM}" visibility="hidden"/>')
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key"><i style="background:{s.color}"></i>{esc(s.name)}'
        + (f' {esc(fmt_value(_peak(s), kind))}, above this scale' if id(s) in off_scale else "") + '</span>'
        for s in series)
    data = {"kind": kind, "t0": int(edges[0]), "t1": int(edges[-1]), "left": LEFT, "pw": PW, "w": W,
            "series": [{"name": s.name, "values": [round(v, 3) for v in s.values]} for s in series]}
    return (f'<figure class="chart" id="{esc(chart_id)}"><figcaption><b>{esc(title)}</b> '
            f'<span class="sub">{esc(subtitle)}</span></figcaption>{"".join(parts)}'
            f'<div class="legend">{legend}</div>'
            f'<script type="application/json" class="chart-data">{json.dumps(data, separators=(",", ":"))}</script>'
            f'</figure>')


def _pack(axis: TimeAxis, items: list[dict]) -> list[list[tuple[float, float, dict]]]:
    """Rows of bars that do not overlap, most severe first, so a critical bar is never hidden."""
    rank = {"critical": 0, "warning": 1, "info": 2}
    rows: list[list[tuple[float, float, dict]]] = []
    for it in sorted(items, key=lambda it: (rank[it["severity"]], it["onset_ns"])):
        x0 = max(LEFT, axis.x(it["onset_ns"]))
        x1 = max(x0 + 3.0, min(LEFT + PW, axis.x(it["end_ns"])))
        for row in rows:
            if all(x1 + 1 < a or x0 > b + 1 for a, b, _ in row):
                row.append((x0, x1, it))
                break
        else:
            rows.append([(x0, x1, it)])
    return rows


def timeline(chart_id: str, title: str, subtitle: str, axis: TimeAxis, lanes: Sequence[tuple[str, list[dict]]]) -> str:
    """One lane per detector; a bar per finding from onset to its end (or to the right edge).
    Findings of one detector that overlap in time are stacked in sub-rows of the lane."""
    bar_h, gap = 14, 4
    packed = [(lane, _pack(axis, items)) for lane, items in lanes]
    num_rows = sum(len(rows) for _, rows in packed)
    height = TOP + BOTTOM + max(1, num_rows) * (bar_h + 3) + len(packed) * gap + 6
    parts = [f'<svg class="plot timeline" data-chart="{esc(chart_id)}" viewBox="0 0 {W} {height}" '
             f'role="img" aria-label="{esc(title)}">']
    for x, label in axis.ticks():
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{height - BOTTOM}"/>'
                     f'<text class="xlab" x="{x:.1f}" y="{height - 6}">{esc(label)}</text>')
    if not lanes:
        parts.append(f'<text class="empty" x="{LEFT + PW / 2}" y="{TOP + 16}">no findings</text>')
    y = TOP + 2
    for lane, rows in packed:
        parts.append(f'<text class="lane" x="{LEFT - 6}" y="{y + 11}">{esc(lane)}</text>')
        for row in rows:
            for x0, x1, it in row:
                cls = "bar ongoing" if it["ongoing"] else "bar"
                parts.append(f'<rect class="{cls}" x="{x0:.1f}" y="{y}" width="{x1 - x0:.1f}" height="{bar_h}" rx="2" '
                             f'fill="{SEVERITY_COLOR[it["severity"]]}" data-finding="{it["index"]}">'
                             f'<title>{esc(it["tooltip"])}</title></rect>')
            y += bar_h + 3
        y += gap
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + PW}" y1="{y - gap / 2:.1f}" y2="{y - gap / 2:.1f}"/>')
    parts.append(f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{height - BOTTOM}" visibility="hidden"/>')
    parts.append("</svg>")
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{s}</span>' for s, c in SEVERITY_COLOR.items())
    data = {"kind": "timeline", "t0": axis.t0, "t1": axis.t1, "left": LEFT, "pw": PW, "w": W, "series": []}
    return (f'<figure class="chart" id="{esc(chart_id)}"><figcaption><b>{esc(title)}</b> '
            f'<span class="sub">{esc(subtitle)}</span></figcaption>{"".join(parts)}'
            f'<div class="legend">{legend}<span class="key">dashed outline: still ongoing</span></div>'
            f'<script type="application/json" class="chart-data">{json.dumps(data, separators=(",", ":"))}</script>'
            f'</figure>')
