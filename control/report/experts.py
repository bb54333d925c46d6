"""The report's view of an offloaded MoE model: expert bytes on the device over time per worker
(against the host copies every expert keeps), and per expert its fetches, evictions and share of
time on the device. Drawn only when the ledger has ``ExpertsMoved`` events."""
from __future__ import annotations

import numpy as np

from residency.control.diagnose.experts import ExpertLedger
from residency.control.diagnose.findings import fmt_bytes
from residency.control.report.bins import step_bins
from residency.control.report.collect import Changes
from residency.control.report.svg import PALETTE, Marker, Series, TimeAxis, chart, esc

MAX_EXPERT_ROWS = 24


def expert_chart(led: ExpertLedger, axis: TimeAxis, edges: np.ndarray, markers: list[Marker]) -> list[str]:
    if not led.workers:
        return []
    series, n = [], len(edges) - 1
    for i, w in enumerate(sorted(led.workers.values(), key=lambda w: w.worker)):
        ch = Changes()
        ch.ts, ch.vals = w.series_ts, w.series_bytes
        low, high, last = step_bins(ch, edges)
        color = PALETTE[i % len(PALETTE)]
        series.append(Series(name=f"worker {w.worker} experts on device", color=color, values=last.tolist(),
                             low=low.tolist(), high=high.tolist()))
        series.append(Series(name=f"worker {w.worker} experts on host (all)", color=color,
                             values=[float(w.host_bytes)] * n, dashed=True, reference=True))
    return [chart("experts-device", "Expert bytes on the device",
                  "an offloaded MoE model (serve --expert-budget): experts in device slots; every expert keeps its host copy",
                  axis, edges, series, "bytes", height=150, markers=markers)]


def expert_tables(led: ExpertLedger, at_ns: int) -> str:
    if not led.workers:
        return ""
    rows, per = [], []
    for w in sorted(led.workers.values(), key=lambda w: w.worker):
        served = w.served_device_bytes + w.served_fetched_bytes
        frac = f"{w.served_device_bytes / served:.1%}" if served else "-"
        moves = [sum(c[i] for c in w.counts.values()) for i in range(3)]
        rows.append(f"<tr><td>{w.worker}</td><td class=\"num\">{fmt_bytes(w.host_bytes)}</td>"
                    f"<td class=\"num\">{fmt_bytes(w.device_bytes)}</td><td class=\"num\">{frac}</td>"
                    f"<td class=\"num\">{fmt_bytes(w.copied_bytes)}</td><td class=\"num\">{moves[0]:,} / {moves[1]:,}</td>"
                    f"<td class=\"num\">{moves[2]:,}</td></tr>")
        busiest = sorted(w.counts.items(), key=lambda kv: (-(kv[1][0] + kv[1][1]), kv[0]))[:MAX_EXPERT_ROWS]
        for key, (f, p, e) in busiest:
            share = w.device_share(key, at_ns)
            per.append(f"<tr><td>{w.worker}</td><td class=\"num\">{key[0]}</td><td class=\"num\">{key[1]}</td>"
                       f"<td class=\"num\">{f:,}</td><td class=\"num\">{p:,}</td><td class=\"num\">{e:,}</td>"
                       f"<td class=\"num\">{'-' if share is None else f'{share:.0%}'}</td>"
                       f"<td>{'device+host' if key in w.since else 'host'}</td></tr>")
    head = ("<table><thead><tr><th>worker</th><th>host bytes</th><th>device bytes now</th><th>served from device</th>"
            "<th>copied in</th><th>fetches / prefetches</th><th>evictions</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>")
    experts = ("<table><thead><tr><th>worker</th><th>layer</th><th>expert</th><th>fetches</th><th>prefetches</th>"
               "<th>evictions</th><th>time on device</th><th>tier now</th></tr></thead>"
               f"<tbody>{''.join(per)}</tbody></table>")
    return (f"<h2>Experts</h2><div class=\"totals\"><div><h3>{esc('Per worker')}</h3>{head}</div>"
            f"<div><h3>{esc('Experts moved most')}</h3>{experts}</div></div>")


__all__ = ["expert_chart", "expert_tables"]
