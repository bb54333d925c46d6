"""`residency timeline --subject block:KEY|session:ID|move:ID|worker:ID`: what touched it, in order."""
from __future__ import annotations

import json

from residency.events.codec import event_to_display_obj
from residency.control.cli.common import add_db_arg, open_store
from residency.control.cli.main import UserError
from residency.control.timeline import SubjectError, one_line, parse_subject, timeline
from residency.control.views import iso


def register(sub) -> None:
    p = sub.add_parser("timeline", help="the events that touched a block, session, move or worker, in order")
    add_db_arg(p)
    p.add_argument("--subject", required=True, help="block:KEY (content key or block id), session:ID, move:ID, worker:ID")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        kind, ident = parse_subject(args.subject)
    except SubjectError as e:
        raise UserError(str(e)) from e
    n = 0
    with open_store(args.db) as store:
        for rec in timeline(store.read(), kind, ident):
            n += 1
            if args.json:
                env = rec.envelope
                print(json.dumps({"seq": env.seq, "ts_ns": env.ts_ns, "producer": env.producer,
                                  "event": event_to_display_obj(rec.event)}))
            else:
                print(one_line(rec, iso))
    if n == 0:
        raise UserError(f"no event in the ledger touches {args.subject}")
    return 0
