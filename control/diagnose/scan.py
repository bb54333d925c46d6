"""One pass over the ledger, each event handed to the detectors that care about its type.

A million events must be diagnosed in seconds, so no detector walks the stream itself: each one
declares ``handlers()`` (event type -> callback) and the pass builds one dispatch table. Shared
bookkeeping (bytes per tier, moves in flight, requests waiting) lives in ``Accounting``, which is
registered first so that detectors see the state *after* the event they are handed.

Every detector is also a pure function of the stream (``detect_*`` in ``control.diagnose``):
the same class run alone over a list of ``Recorded``; time comes in as ``at_ns``, never the clock.
"""
from __future__ import annotations

import itertools
from typing import Callable, ClassVar, Iterable, Protocol

import msgspec

from residency.events import Recorded
from residency.control.diagnose.findings import Finding, sort_findings
from residency.control.diagnose.params import DiagnoseParams

Handler = Callable[[Recorded], None]


class Observer(Protocol):
    def handlers(self) -> dict[type, Handler]:
        """Event type -> callback. Callbacks mutate the observer only; they return nothing."""


class Detector(Observer, Protocol):
    name: ClassVar[str]

    def finish(self, at_ns: int) -> list[Finding]:
        """Findings for the stream seen so far, judged at ``at_ns``. Called once: it ends the pass."""


class PassSummary(msgspec.Struct, kw_only=True):
    num_events: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    first_ts_ns: int | None = None
    last_ts_ns: int | None = None
    counts: dict[str, int] = {}       # events by type name
    last_type: str | None = None      # the last event's type name


class Diagnosis(msgspec.Struct, kw_only=True):
    at_ns: int
    at_seq: int | None
    num_events: int
    first_ts_ns: int | None
    last_ts_ns: int | None
    findings: list[Finding]


def run_pass(events: Iterable[Recorded], observers: Iterable[Observer]) -> PassSummary:
    """Feed every event to the observers' handlers, in observer order. Returns what was seen."""
    table: dict[type, list[Handler]] = {}
    for obs in observers:
        for etype, fn in obs.handlers().items():
            table.setdefault(etype, []).append(fn)
    dispatch = {etype: tuple(fns) for etype, fns in table.items()}
    summary = PassSummary()
    counts: dict[type, int] = {}
    get, count = dispatch.get, counts.get
    it = iter(events)
    rec = first = next(it, None)
    if first is not None:
        summary.first_seq = first.envelope.seq
        summary.first_ts_ns = first.envelope.ts_ns
        it = itertools.chain((first,), it)
    # NOTE: the hot loop of diagnose and report: a million turns, so nothing in it but a dict
    # lookup, a count and the handlers' calls.
    for rec in it:
        cls = rec.event.__class__
        counts[cls] = count(cls, 0) + 1
        fns = get(cls)
        if fns:
            for fn in fns:
                fn(rec)
    if rec is not None:
        summary.last_seq = rec.envelope.seq
        summary.last_ts_ns = rec.envelope.ts_ns
        summary.last_type = rec.event.__class__.__name__
    summary.counts = {cls.__name__: n for cls, n in counts.items()}
    summary.num_events = sum(counts.values())
    return summary


def diagnose(
    events: Iterable[Recorded],
    at_ns: int | None = None,
    params: DiagnoseParams | None = None,
    *,
    observers: Iterable[Observer] = (),
    detectors: Iterable[type] | None = None,
) -> Diagnosis:
    """Run the detectors over ``events`` (already cut at the point to diagnose) in one pass.

    ``at_ns`` is "now" for the detectors; ``None`` means the last event's time. ``observers``
    ride along the same pass (the report collects its series this way).
    """
    from residency.control.diagnose import ALL_DETECTORS  # noqa: PLC0415
    from residency.control.diagnose.accounting import Accounting  # noqa: PLC0415

    params = params or DiagnoseParams()
    acct = Accounting()
    dets = [cls(acct, params) for cls in (detectors if detectors is not None else ALL_DETECTORS)]
    summary = run_pass(events, [acct, *observers, *dets])
    if at_ns is None:
        at_ns = summary.last_ts_ns if summary.last_ts_ns is not None else 0
    elif summary.last_type == "ServerStopped" and at_ns > summary.last_ts_ns:
        # NOTE: a ledger that ends with a clean stop is closed: no time passes for a server that
        # is not running, so judging it later (``--at now``) must find what judging it at the stop
        # finds. A ledger that ends any other way may belong to a live server and is judged as asked.
        at_ns = summary.last_ts_ns
    findings: list[Finding] = []
    for det in dets:
        findings.extend(det.finish(at_ns))
    return Diagnosis(
        at_ns=at_ns,
        at_seq=summary.last_seq,
        num_events=summary.num_events,
        first_ts_ns=summary.first_ts_ns,
        last_ts_ns=summary.last_ts_ns,
        findings=sort_findings(findings),
    )


def detect_with(cls: type, events: Iterable[Recorded], at_ns: int, params: DiagnoseParams | None) -> list[Finding]:
    """Run one detector alone over a stream: the pure-function form of every detector."""
    from residency.control.diagnose.accounting import Accounting  # noqa: PLC0415

    acct = Accounting()
    det = cls(acct, params or DiagnoseParams())
    run_pass(events, [acct, det])
    return sort_findings(det.finish(at_ns))
