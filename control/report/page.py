"""The report page: one self-contained HTML file (inline CSS, inline SVG, a little inline JS).

Nothing is fetched: no CDN, no font, no image. The script only adds a synchronized cursor with a
readout and marks ``<body data-rendered="1">`` once it has run, which the headless test checks.
"""
from __future__ import annotations

from residency.control.diagnose.scan import Diagnosis
from residency.control.diagnose.findings import SEVERITY_RANK, fmt_bytes, fmt_duration
from residency.control.diagnose.text import iso_ns
from residency.control.report.bins import count_bins, step_bins
from residency.control.report.collect import OUTCOMES, ReportCollector
from residency.control.report.experts import expert_chart, expert_tables
from residency.control.report.svg import PALETTE, SEVERITY_COLOR, Marker, Series, TimeAxis, chart, esc, timeline
from residency.events import MOVE_KINDS, TIERS

MAX_FINDINGS_DRAWN = 2000
MAX_FINDINGS_LISTED = 500
MAX_MARKERS = 60

_OUTCOME_COLORS = {"MoveAcked": "#59a14f", "MoveLateAcked": "#76b7b2", "MoveFailed": "#e15759",
                   "MoveRejected": "#f28e2b", "MoveStranded": "#b07aa1", "MoveAbandoned": "#9c755f",
                   "MoveLateFailed": "#bab0ac"}

CSS = """
:root{--fg:#1d2330;--muted:#6b7385;--line:#e3e6ee;--bg:#f6f7fa;--card:#fff}
*{box-sizing:border-box}body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:18px 28px 8px}h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 8px}
.meta{color:var(--muted);font-size:13px}main{padding:0 28px 40px;max-width:1240px}
.kpis{display:grid;grid-template-columns:repeat(auto-fill,minmax(136px,1fr));gap:10px;margin:12px 0 6px}
.kpi{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 12px}
.kpi b{display:block;font-size:20px}.kpi span{color:var(--muted);font-size:12px}
.kpi.crit b{color:#d62728}.kpi.warn b{color:#b57600}
.chart{background:var(--card);border:1px solid var(--line);border-radius:8px;margin:0 0 12px;padding:8px 10px 6px;position:relative}
figcaption{margin:0 0 4px}figcaption .sub{color:var(--muted);font-size:12px;margin-left:6px}
svg.plot{display:block;overflow:visible;width:100%;height:auto}
.grid{stroke:#eef0f4;stroke-width:1}.axis{stroke:#9aa1b2;stroke-width:1}.tick{stroke:#9aa1b2}
.xlab{font-size:11px;fill:var(--muted);text-anchor:middle}.ylab,.lane{font-size:11px;fill:var(--muted);text-anchor:end}
.empty{font-size:12px;fill:var(--muted);text-anchor:middle}
.line{fill:none;stroke-width:1.6;vector-effect:non-scaling-stroke}.band{opacity:.18;stroke:none}.area{opacity:.85;stroke:none}
.marker{stroke-width:1;stroke-dasharray:2 3;opacity:.7}.cursor{stroke:#1d2330;stroke-width:1;opacity:.5;pointer-events:none}
.bar{cursor:pointer}.bar.ongoing{stroke:#1d2330;stroke-width:1;stroke-dasharray:3 2}
.legend{font-size:12px;color:var(--muted);display:flex;flex-wrap:wrap;gap:4px 14px;margin:2px 0 2px 8px}
.key i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.tip{position:fixed;pointer-events:none;background:#1d2330;color:#fff;font-size:12px;padding:6px 8px;border-radius:6px;
 white-space:nowrap;z-index:9;display:none;box-shadow:0 2px 8px rgba(0,0,0,.2)}
table{border-collapse:collapse;background:var(--card);border:1px solid var(--line);border-radius:8px;width:100%;font-size:13px}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid var(--line);vertical-align:top}th{color:var(--muted);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.sev{font-weight:700;font-size:11px;text-transform:uppercase}.sev.critical{color:#d62728}.sev.warning{color:#b57600}.sev.info{color:#5d7ea0}
tr.hit{background:#fff6d6}.sugg{color:var(--muted)}.seqs{font-family:ui-monospace,monospace;font-size:12px;color:var(--muted)}
.totals{display:grid;grid-template-columns:repeat(auto-fit,minmax(360px,1fr));gap:12px}
"""

JS = """
(function(){
  var tip=document.createElement('div');tip.className='tip';document.body.appendChild(tip);
  var plots=[].slice.call(document.querySelectorAll('svg.plot'));
  function data(svg){var s=svg.parentNode.querySelector('script.chart-data');return s?JSON.parse(s.textContent):null}
  function fmt(v,kind){if(kind!=='bytes')return (Math.round(v*100)/100).toLocaleString();
    var u=[['TiB',1099511627776],['GiB',1073741824],['MiB',1048576],['KiB',1024]];for(var i=0;i<u.length;i++){if(Math.abs(v)>=u[i][1])return (v/u[i][1]).toFixed(1)+' '+u[i][0]}return v+' B'}
  function iso(ns){return new Date(ns/1e6).toISOString().replace('T',' ').replace('Z',' UTC')}
  plots.forEach(function(svg){
    var d=data(svg);if(!d)return;svg.__d=d;
    svg.addEventListener('mousemove',function(e){
      var r=svg.getBoundingClientRect(),vx=(e.clientX-r.left)/r.width*d.w;
      if(vx<d.left||vx>d.left+d.pw){hide();return}
      plots.forEach(function(p){var c=p.querySelector('.cursor');c.setAttribute('x1',vx);c.setAttribute('x2',vx);c.setAttribute('visibility','visible')});
      var f=(vx-d.left)/d.pw,t=d.t0+f*(d.t1-d.t0),rows=['<b>'+iso(t)+'</b>'];
      d.series.forEach(function(s){var i=Math.min(s.values.length-1,Math.floor(f*s.values.length));rows.push(s.name+': '+fmt(s.values[i],d.kind))});
      tip.innerHTML=rows.join('<br>');tip.style.display='block';
      tip.style.left=Math.min(e.clientX+14,window.innerWidth-tip.offsetWidth-8)+'px';tip.style.top=(e.clientY+14)+'px';
    });
    svg.addEventListener('mouseleave',hide);
  });
  function hide(){tip.style.display='none';plots.forEach(function(p){p.querySelector('.cursor').setAttribute('visibility','hidden')})}
  [].slice.call(document.querySelectorAll('rect[data-finding]')).forEach(function(r){
    r.addEventListener('click',function(){var row=document.getElementById('f-'+r.getAttribute('data-finding'));
      if(row){[].slice.call(document.querySelectorAll('tr.hit')).forEach(function(x){x.classList.remove('hit')});row.classList.add('hit');row.scrollIntoView({block:'center'})}});
  });
  document.body.setAttribute('data-charts',String(plots.length));
  document.body.setAttribute('data-rendered','1');
})();
"""


def _kpi(value: str, label: str, cls: str = "") -> str:
    return f'<div class="kpi {cls}"><b>{esc(value)}</b><span>{esc(label)}</span></div>'


def _table(headers: list[str], rows: list[list[str]], num_cols: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in num_cols else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _band_series(name: str, color: str, binned, line: str = "last") -> Series:
    """A step function as a band (lowest..highest in each bin) and a line: the value each bin
    ended on, or its peak where the peak is the story (moves in flight)."""
    low, high, last = binned
    values = high if line == "high" else last
    return Series(name=name, color=color, values=values.tolist(), low=low.tolist(), high=high.tolist())


def render_page(d: Diagnosis, col: ReportCollector, source: str, t0: int, t1: int, num_bins: int) -> str:
    from residency.control.report.bins import make_edges  # noqa: PLC0415

    edges = make_edges(t0, t1, num_bins)
    # counts per bin are noisy at the resolution of a level: coarser bins for them, same axis
    num_count_bins = max(1, num_bins // 3)
    cedges = make_edges(t0, t1, num_count_bins)
    axis = TimeAxis(int(edges[0]), int(edges[-1]))
    bin_s = fmt_duration(int((edges[-1] - edges[0]) / num_count_bins))
    acct = col.acct
    crit = [f for f in d.findings if f.severity == "critical"][:MAX_MARKERS]
    markers = [Marker(t_ns=max(f.onset_ns, t0), color=SEVERITY_COLOR["critical"], label=f.title) for f in crit]
    sections: list[str] = []

    # ---------------------------------------------------------------- findings on the timeline
    lanes: dict[str, list[dict]] = {}
    for i, f in enumerate(d.findings[:MAX_FINDINGS_DRAWN]):
        end = f.until_ns if f.until_ns is not None else d.at_ns
        lanes.setdefault(f.detector, []).append({
            "onset_ns": f.onset_ns, "end_ns": max(end, f.onset_ns), "ongoing": f.until_ns is None,
            "severity": f.severity, "index": i,
            "tooltip": f"{f.severity.upper()} {f.title}\n{iso_ns(f.onset_ns)} for {fmt_duration(f.duration_ns(d.at_ns))}"
                       f"{' (ongoing)' if f.until_ns is None else ''}\nsuggest: {f.suggestion}",
        })
    lane_order = sorted(lanes, key=lambda k: (min(SEVERITY_RANK[it["severity"]] for it in lanes[k]), k))
    sections.append(timeline("findings", "Diagnose findings", "one lane per detector; click a bar for its row below",
                             axis, [(k, lanes[k]) for k in lane_order]))

    # ---------------------------------------------------------------- bytes per tier and worker
    workers = sorted({w for (w, _) in col.usage} | set(acct.block_bytes))
    for tier in TIERS:
        series = []
        for i, w in enumerate(workers):
            ch = col.usage.get((w, tier))
            if ch is None:
                continue
            series.append(_band_series(f"worker {w} used", PALETTE[i % len(PALETTE)], step_bins(ch, edges)))
        if not series:
            continue
        caps = {acct.capacity.get((w, tier)) for w in workers} - {None}
        n = len(edges) - 1
        if len(caps) == 1:
            series.append(Series(name="capacity", color="#9aa1b2", values=[float(caps.pop())] * n, dashed=True,
                                 reference=True))
        for i, w in enumerate(workers):
            floor = col.budgets.get((w, tier), (0, 0))[0]
            cap = acct.capacity.get((w, tier))
            if floor and cap:
                series.append(Series(name=f"worker {w} capacity - floor", color=PALETTE[i % len(PALETTE)],
                                     values=[float(cap - floor)] * n, dashed=True, reference=True))
        sections.append(chart(f"bytes-{tier}", f"Bytes on {tier}", "per worker; band = lowest..highest within a bin",
                              axis, edges, series, "bytes", markers=markers))

    # ---------------------------------------------------------------- moves
    kinds = [k for k in MOVE_KINDS if k in col.requested]
    sections.append(chart("moves-requested", "Moves requested", f"by kind, per {bin_s}", axis, cedges,
                          [Series(name=k, color=PALETTE[i % len(PALETTE)], values=count_bins(col.requested[k], cedges).tolist())
                           for i, k in enumerate(kinds)], "count", stacked=True, markers=markers))
    outs = [o for o in OUTCOMES if len(col.outcomes[o].ts)]
    sections.append(chart("moves-outcomes", "Move outcomes", f"by outcome, per {bin_s}", axis, cedges,
                          [Series(name=o.removeprefix("Move").lower(), color=_OUTCOME_COLORS[o],
                                  values=count_bins(col.outcomes[o], cedges).tolist()) for o in outs],
                          "count", stacked=True, markers=markers))
    sections.append(chart("moves-inflight", "Moves in flight", "peak count in each bin; band = lowest..highest", axis, edges,
                          [_band_series("moves in flight", PALETTE[0], step_bins(col.inflight, edges), line="high")],
                          "count", height=140, markers=markers))
    sections.append(chart("bytes-inflight", "Bytes in flight", "peak planned bytes of the moves in flight in each bin", axis, edges,
                          [_band_series("bytes in flight", PALETTE[1], step_bins(col.inflight_bytes, edges), line="high")],
                          "bytes", height=140, markers=markers))
    sections.append(chart("stranded", "Stranded bytes", "outstanding: stranded and not late-acked, plus only-copy bytes of lost workers",
                          axis, edges, [_band_series("stranded bytes", "#b07aa1", step_bins(col.stranded, edges))],
                          "bytes", height=140, markers=markers))

    if col.experts is not None:       # an offloaded MoE model's experts (control/report/experts.py)
        sections += expert_chart(col.experts, axis, edges, markers)

    # ---------------------------------------------------------------- refusals, requests, steps
    rkeys = sorted(col.refusals)
    sections.append(chart("refusals", "Refusals", f"per {bin_s}", axis, cedges,
                          [Series(name=k, color=PALETTE[(i + 3) % len(PALETTE)], values=count_bins(col.refusals[k], cedges).tolist())
                           for i, k in enumerate(rkeys)], "count", stacked=True, height=150, markers=markers))
    sections.append(chart("requests-waiting", "Requests waiting", "admitted and not finished", axis, edges,
                          [_band_series("requests waiting", PALETTE[4], step_bins(col.waiting, edges))],
                          "count", height=140, markers=markers))
    sections.append(chart("steps", "Steps completed", f"all workers, per {bin_s}", axis, cedges,
                          [Series(name="steps", color=PALETTE[2], values=count_bins(col.steps, cedges).tolist())],
                          "count", stacked=True, height=120, markers=markers))

    return _assemble(d, col, source, sections)


def _assemble(d: Diagnosis, col: ReportCollector, source: str, sections: list[str]) -> str:
    sev = {s: sum(1 for f in d.findings if f.severity == s) for s in ("critical", "warning", "info")}
    acked = col.counts.get("MoveAcked", 0) + col.counts.get("MoveLateAcked", 0) + col.counts.get("CopiesReleased", 0)
    num_moves = sum(col.num_moves.values())
    stranded_now = sum(col.stranded_by_why.values())
    span = (d.last_ts_ns or 0) - (d.first_ts_ns or 0)
    kpis = "".join([
        _kpi(f"{d.num_events:,}", "events"),
        _kpi(fmt_duration(span), "span of the ledger"),
        _kpi(f"{num_moves:,}", f"moves ({100 * acked / num_moves:.1f}% acked)" if num_moves else "moves"),
        _kpi(fmt_bytes(col.bytes_moved), "bytes moved (acked)"),
        _kpi(fmt_bytes(stranded_now), "stranded bytes outstanding", "warn" if stranded_now else ""),
        _kpi(f"{col.counts.get('MoveRefused', 0) + col.counts.get('RequestRefused', 0):,}", "refusals"),
        _kpi(f"{sev['critical']}", "critical findings", "crit" if sev["critical"] else ""),
        _kpi(f"{sev['warning']} / {sev['info']}", "warnings / info", "warn" if sev["warning"] else ""),
    ])
    rows = []
    for i, f in enumerate(d.findings[:MAX_FINDINGS_LISTED]):
        span_txt = (f"{fmt_duration(f.duration_ns(d.at_ns))} so far" if f.until_ns is None
                    else fmt_duration(f.duration_ns(d.at_ns)))
        seqs = ", ".join(map(str, f.seqs[:10])) + (" …" if len(f.seqs) > 10 else "")
        rows.append(f'<tr id="f-{i}"><td><span class="sev {f.severity}">{f.severity}</span></td>'
                    f"<td>{esc(f.detector)}</td><td>{esc(iso_ns(f.onset_ns))}<br>{esc(span_txt)}</td>"
                    f'<td>{esc(f.title)}<div class="sugg">suggest: {esc(f.suggestion)}</div>'
                    f'<div class="seqs">seq {esc(seqs)}</div></td></tr>')
    more = (f'<p class="meta">{len(d.findings) - MAX_FINDINGS_LISTED} more findings not listed '
            f"(`residency diagnose --json` has them all)</p>" if len(d.findings) > MAX_FINDINGS_LISTED else "")
    findings_table = ("<table><thead><tr><th>severity</th><th>detector</th><th>when</th><th>finding</th></tr></thead>"
                      f"<tbody>{''.join(rows)}</tbody></table>{more}" if rows
                      else '<p class="meta">No findings: nothing wedged, stalled, stranded or over budget.</p>')

    reclaimed = sorted(col.reclaimed.items(), key=lambda kv: -kv[1])
    by_tier: dict[str, int] = {}
    for (tier, _), b in reclaimed:
        by_tier[tier] = by_tier.get(tier, 0) + b
    reclaimed_rows = [[esc(t), "<b>all</b>", f"<b>{fmt_bytes(b)}</b>"] for t, b in sorted(by_tier.items())]
    reclaimed_rows += [[esc(t), esc(c), fmt_bytes(b)] for (t, c), b in reclaimed[:24]]
    stranded_rows = [[esc(w), fmt_bytes(b)] for w, b in sorted(col.stranded_by_why.items()) if b] or [["(none)", "0 B"]]
    outcome_rows = [[esc(o.removeprefix("Move").lower()), f"{len(col.outcomes[o].ts):,}"] for o in OUTCOMES]
    outcome_rows += [[f"requested: {esc(k)}", f"{n:,}"] for k, n in sorted(col.num_moves.items())]
    event_rows = [[esc(k), f"{n:,}"] for k, n in sorted(col.counts.items(), key=lambda kv: -kv[1])]
    totals = (
        '<div class="totals">'
        f"<div><h3>Reclaimed bytes (from acks and frees)</h3>{_table(['tier', 'cause', 'bytes'], reclaimed_rows, {2})}</div>"
        f"<div><h3>Stranded bytes outstanding</h3>{_table(['why', 'bytes'], stranded_rows, {1})}"
        f"<h3>Moves</h3>{_table(['outcome', 'count'], outcome_rows, {1})}</div>"
        f"<div><h3>Events by type</h3>{_table(['type', 'count'], event_rows, {1})}</div>"
        "</div>"
    )
    at = f"seq {d.at_seq}" if d.at_seq is not None else "empty ledger"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>Residency report: {esc(source)}</title><style>{CSS}</style></head>"
        "<body data-rendered=\"0\">"
        f"<header><h1>Residency ledger report</h1><div class=\"meta\">{esc(source)} · {d.num_events:,} events through {esc(at)} · "
        f"{esc(iso_ns(d.first_ts_ns))} → {esc(iso_ns(d.last_ts_ns))} · judged at {esc(iso_ns(d.at_ns))}</div></header>"
        f"<main><section class=\"kpis\">{kpis}</section>"
        f"<h2>Timeline</h2>{''.join(sections)}"
        f"<h2>Findings</h2>{findings_table}"
        f"<h2>Audit totals</h2>{totals}"
        f"{expert_tables(col.experts, d.at_ns) if col.experts is not None else ''}"
        f"</main><script>{JS}</script></body></html>\n"
    )
