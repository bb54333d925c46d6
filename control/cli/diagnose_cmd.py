"""`residency diagnose`: run the detectors over the ledger and print what is wrong, with proof.

Reads the ledger through ``--at`` (a seq, an ISO 8601 time, or ``now``) in one pass; "now" for
the detectors is that point's time: the event at that seq, the time given, or the wall clock for
``--at now`` (the one place a clock is read, so a ledger gone silent can be judged against today).
"""
from __future__ import annotations

import sys
import time

import msgspec

from residency.control.cli.common import add_db_arg, open_store, parse_time_ns, progress_bar
from residency.control.cli.main import UserError
from residency.control.diagnose import DiagnoseParams, diagnose
from residency.control.diagnose.params import SECOND
from residency.control.diagnose.text import iso_ns, render_text


def add_at_arg(parser) -> None:
    parser.add_argument("--at", metavar="SEQ|TIME", default=None,
                        help="judge the ledger as it stood at this seq, or ISO 8601 time (UTC if naive); "
                             "'now' reads the whole ledger and judges it at the wall clock (default: the last event)")


def add_param_args(parser) -> None:
    parser.add_argument("--stall-after", type=float, metavar="S", default=None,
                        help=f"seconds of no progress with requests waiting that make a stall "
                             f"(default {DiagnoseParams().stall_after_ns / SECOND:g})")
    parser.add_argument("--group", action="append", default=[], metavar="NAME=W,W",
                        help="workers that form one group (repeatable); default: inferred from agreeing digests")


def params_from(args) -> DiagnoseParams:
    kw = {}
    if args.stall_after is not None:
        if args.stall_after <= 0:
            raise UserError(f"--stall-after must be positive, got {args.stall_after:g}")
        kw["stall_after_ns"] = int(args.stall_after * SECOND)
    groups = {}
    for spec in args.group:
        name, _, members = spec.partition("=")
        try:
            workers = [int(w) for w in members.split(",") if w.strip()]
        except ValueError:
            workers = []
        if not name or len(workers) < 2:
            raise UserError(f"--group wants NAME=W,W with two or more worker numbers, got {spec!r}")
        groups[name] = workers
    if groups:
        kw["groups"] = groups
    return DiagnoseParams(**kw)


def resolve_at(store, at: str | None) -> tuple[int, int | None]:
    """(last seq to read, "now" in ns or None for the last event's time); raises UserError."""
    last = store.last_seq()
    if at is None:
        return last, None
    at = at.strip()
    if at.isdigit():
        seq = int(at)
        if seq < 1 or seq > last:
            raise UserError(f"--at {seq} is beyond the end of the ledger (last seq {last})" if seq > last
                            else "--at wants a seq of 1 or more")
        return seq, None
    if at == "now":
        return last, time.time_ns()
    ts = parse_time_ns(at)
    if last == 0:
        raise UserError(f"--at {at}: the ledger is empty")
    first_ts = next(store.read(1, 1)).envelope.ts_ns
    last_ts = next(store.read(last, last)).envelope.ts_ns
    if ts < first_ts:
        raise UserError(f"--at {at} is before the ledger begins (first event at {iso_ns(first_ts)})")
    if ts > last_ts:
        raise UserError(f"--at {at} is beyond the end of the ledger (last event at {iso_ns(last_ts)}, seq {last}); "
                        "use --at now to judge a silent ledger against the wall clock")
    return store.seq_at_time(ts), ts


def read_events(store, to_seq: int, desc: str):
    """The events 1..to_seq, with a progress bar on a terminal."""
    with progress_bar(to_seq, desc) as update:
        n = 0
        for rec in store.read(1, to_seq):
            yield rec
            n += 1
            if n == 50_000:
                update(n)
                n = 0
        update(n)


def register(sub) -> None:
    p = sub.add_parser("diagnose", help="find wedges, stalls, stranded bytes and broken budgets in the ledger")
    add_db_arg(p)
    add_at_arg(p)
    p.add_argument("--json", action="store_true", help="print every finding as JSON")
    add_param_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    params = params_from(args)
    with open_store(args.db) as store:
        to_seq, at_ns = resolve_at(store, args.at)
        d = diagnose(read_events(store, to_seq, "diagnose"), at_ns, params)
        source = store.url
    if args.json:
        out = {"ledger": source, "at_seq": d.at_seq, "at_ns": d.at_ns, "at": iso_ns(d.at_ns),
               "num_events": d.num_events, "findings": d.findings}
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        print(render_text(d, source))
    return 0
