"""`residency report`: one self-contained HTML file with the ledger's story as pictures.

``build_report(events, ...)`` runs the diagnosis and the report's series collection in the same
single pass over the events, then bins the series and draws them as inline SVG.
"""
from __future__ import annotations

from typing import Iterable

from residency.events import Recorded
from residency.control.diagnose import ALL_DETECTORS, DiagnoseParams
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.experts import ExpertLedger
from residency.control.diagnose.scan import Diagnosis, run_pass
from residency.control.diagnose.findings import sort_findings
from residency.control.report.collect import ReportCollector
from residency.control.report.page import render_page

DEFAULT_BINS = 480


def collect(events: Iterable[Recorded], at_ns: int | None = None,
            params: DiagnoseParams | None = None) -> tuple[Diagnosis, ReportCollector]:
    """One pass: the diagnosis and the report's series."""
    params = params or DiagnoseParams()
    acct = Accounting()
    col = ReportCollector(acct)
    col.experts = ExpertLedger()
    dets = [cls(acct, params) for cls in ALL_DETECTORS]
    summary = run_pass(events, [acct, col, col.experts, *dets])
    col.counts = summary.counts
    if at_ns is None:
        at_ns = summary.last_ts_ns if summary.last_ts_ns is not None else 0
    findings = sort_findings([f for det in dets for f in det.finish(at_ns)])
    d = Diagnosis(at_ns=at_ns, at_seq=summary.last_seq, num_events=summary.num_events,
                  first_ts_ns=summary.first_ts_ns, last_ts_ns=summary.last_ts_ns, findings=findings)
    return d, col


def build_report(events: Iterable[Recorded], source: str, at_ns: int | None = None,
                 params: DiagnoseParams | None = None, num_bins: int = DEFAULT_BINS) -> str:
    """The whole HTML page as a string."""
    d, col = collect(events, at_ns, params)
    t0 = d.first_ts_ns if d.first_ts_ns is not None else d.at_ns
    t1 = max(d.at_ns, d.last_ts_ns or d.at_ns)
    return render_page(d, col, source, t0, t1, num_bins)


__all__ = ["build_report", "collect", "DEFAULT_BINS"]
