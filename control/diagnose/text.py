"""Findings as text for a terminal: most severe first, each with its proof and its advice."""
from __future__ import annotations

from datetime import datetime, timezone

from residency.control.diagnose.scan import Diagnosis
from residency.control.diagnose.findings import Finding, fmt_duration

# Past this many findings of one detector, the rest are counted, not printed (``--json`` has all).
MAX_PER_DETECTOR = 10


def iso_ns(ns: int | None) -> str:
    if ns is None:
        return "-"
    dt = datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{(ns // 1_000_000) % 1000:03d}Z"


def render_finding(f: Finding, at_ns: int) -> list[str]:
    span = (f"since {iso_ns(f.onset_ns)}, ongoing ({fmt_duration(f.duration_ns(at_ns))} so far)"
            if f.until_ns is None else
            f"{iso_ns(f.onset_ns)} .. {iso_ns(f.until_ns)} ({fmt_duration(f.duration_ns(at_ns))})")
    seqs = ", ".join(str(s) for s in f.seqs[:12]) + (f" (+{len(f.seqs) - 12})" if len(f.seqs) > 12 else "")
    return [
        f"{f.severity.upper():<8} {f.detector:<18} {f.title}",
        f"{'':27}{span}",
        f"{'':27}proof: seq {seqs}",
        f"{'':27}suggest: {f.suggestion}",
    ]


def render_text(d: Diagnosis, source: str) -> str:
    lines = [
        f"ledger {source}: {d.num_events} events"
        + (f", seq {d.at_seq}" if d.at_seq is not None else "")
        + f", judged at {iso_ns(d.at_ns)}"
        + (f" ({fmt_duration(d.at_ns - d.last_ts_ns)} after the last event)"
           if d.last_ts_ns is not None and d.at_ns > d.last_ts_ns else ""),
    ]
    if not d.findings:
        lines.append("no findings: nothing wedged, stalled, stranded or over budget")
        return "\n".join(lines)
    counts: dict[str, int] = {}
    for f in d.findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    lines.append(", ".join(f"{n} {sev}" for sev, n in counts.items()))
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    for f in d.findings:
        if shown.get(f.detector, 0) >= MAX_PER_DETECTOR:
            hidden[f.detector] = hidden.get(f.detector, 0) + 1
            continue
        shown[f.detector] = shown.get(f.detector, 0) + 1
        lines.append("")
        lines.extend(render_finding(f, d.at_ns))
    if hidden:
        lines.append("")
        lines.append("not shown (use --json for all): "
                     + ", ".join(f"{n} more {det}" for det, n in sorted(hidden.items())))
    return "\n".join(lines)
