"""`residency replay`: fold the ledger to a point and print the state, or what changed between two points."""
from __future__ import annotations

import json

from residency.control.cli.common import add_db_arg, open_store, parse_time_ns, progress_bar
from residency.control.cli.main import UserError
from residency.control.replay import ReplayError, replay
from residency.control.views import diff_summaries, render_text, summarize


def register(sub) -> None:
    p = sub.add_parser("replay", help="fold the ledger to a point and print the state of every byte")
    add_db_arg(p)
    at = p.add_mutually_exclusive_group()
    at.add_argument("--at", type=int, metavar="SEQ", help="fold through this seq (default: the end)")
    at.add_argument("--at-time", metavar="ISO8601", help="fold through the last event at or before this time")
    at.add_argument("--diff", metavar="A..B", help="what changed in the state between seq A and seq B")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--no-snapshots", action="store_true", help="fold from zero even if snapshots exist")
    p.set_defaults(func=run)


def _fold_to(store, seq, args):
    total = store.last_seq() if seq is None else seq
    with progress_bar(total, "replay") as update:
        try:
            state, snap = replay(store, seq, use_snapshots=not args.no_snapshots, progress=update)
        except ReplayError as e:
            raise UserError(str(e)) from e
    return state, snap


def run(args) -> int:
    with open_store(args.db) as store:
        if args.diff:
            try:
                a_text, b_text = args.diff.split("..")
                a, b = int(a_text), int(b_text)
            except ValueError as e:
                raise UserError(f"--diff wants A..B with two seqs, got {args.diff!r}") from e
            if a > b:
                raise UserError(f"--diff {args.diff}: A must not be after B")
            sa = summarize(_fold_to(store, a, args)[0])
            sb = summarize(_fold_to(store, b, args)[0])
            lines = diff_summaries(sa, sb)
            print(json.dumps({"from": a, "to": b, "changes": lines[1:]}, indent=2) if args.json else "\n".join(lines))
            return 0
        seq = args.at
        if args.at_time:
            seq = store.seq_at_time(parse_time_ns(args.at_time))
        state, snap = _fold_to(store, seq, args)
        summary = summarize(state)
        summary["snapshot_seq"] = snap
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print(render_text(summary))
            if snap:
                print(f"(replay started from the snapshot at seq {snap})")
    return 0
