"""`residency ledger init|current|upgrade|downgrade|verify|anchor|export|import|snapshot`."""
from __future__ import annotations

import os
import sys

from residency.control.cli.common import add_db_arg, check_sqlite_path, open_store, progress_bar
from residency.control.cli.main import UserError
from residency.control.replay import check_checkpoints, older_checkpoints, write_snapshots


def register(sub) -> None:
    p = sub.add_parser("ledger", help="create, migrate, verify, export and import a ledger")
    lsub = p.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    q = lsub.add_parser("init", help="create the schema (or upgrade it) through Alembic")
    add_db_arg(q)
    q.set_defaults(func=_init)
    q = lsub.add_parser("current", help="print the schema revision")
    add_db_arg(q)
    q.set_defaults(func=_current)
    q = lsub.add_parser("upgrade", help="upgrade the schema")
    add_db_arg(q)
    q.add_argument("revision", nargs="?", default="head", help="Alembic revision to upgrade to (default head)")
    q.set_defaults(func=_upgrade)
    q = lsub.add_parser("downgrade", help="downgrade the schema")
    add_db_arg(q)
    q.add_argument("revision", help="Alembic revision to downgrade to, e.g. 0002 or -1")
    q.set_defaults(func=_downgrade)

    q = lsub.add_parser("verify", help="check seqs, the hash chain, every payload, and the state checkpoints")
    add_db_arg(q)
    q.add_argument("--no-checkpoints", action="store_true", help="skip replaying to each StateCheckpoint")
    q.add_argument("--expect-head", action="append", default=[], metavar="SEQ:HASH",
                   help="a head kept outside the database (as `verify` prints it): the ledger must reach SEQ "
                        "with that hash there (repeatable)")
    _add_anchor_args(q, "check every head in FILE (written by `serve --anchor` or `ledger anchor`)")
    q.set_defaults(func=_verify)

    q = lsub.add_parser("anchor", help="verify the ledger, then append its head to an anchor file kept elsewhere")
    add_db_arg(q)
    _add_anchor_args(q, "the anchor file to append the head to (its heads are checked first)", required=True)
    q.set_defaults(func=_anchor)

    q = lsub.add_parser("export", help="write the ledger as JSON lines")
    add_db_arg(q)
    q.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format (JSON lines, one event a line)")
    q.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    q.set_defaults(func=_export)

    q = lsub.add_parser("import", help="load a JSON-lines export into a new or empty ledger, re-verifying the chain")
    add_db_arg(q)
    q.add_argument("input", help="file to read ('-' for stdin)")
    q.set_defaults(func=_import)

    q = lsub.add_parser("snapshot", help="save replay snapshots so `replay --at` starts near its target")
    add_db_arg(q)
    q.add_argument("--every", type=int, default=100_000, metavar="N", help="a snapshot every N events (default 100000)")
    q.set_defaults(func=_snapshot)


def _add_anchor_args(q, help_file: str, required: bool = False) -> None:
    q.add_argument("--anchor", metavar="FILE", required=required, help=help_file)
    q.add_argument("--anchor-key", metavar="KEYFILE",
                   help="the key the anchor lines are keyed with (HMAC-SHA256); keep it away from the database")


def _anchors(args, create: bool = False) -> tuple[list, bytes | None]:
    """(the anchors to check, the key) from --expect-head, --anchor and --anchor-key."""
    from residency.ledger import anchor  # noqa: PLC0415

    key = anchor.load_key(args.anchor_key) if args.anchor_key else None
    if key is not None and not args.anchor:
        raise UserError("--anchor-key needs --anchor FILE")
    found = [anchor.parse_head(h) for h in getattr(args, "expect_head", [])]
    if args.anchor and not (create and not os.path.exists(args.anchor)):
        found += anchor.read(args.anchor, key)
    return found, key


def _migrate():
    from residency.ledger import migrate  # noqa: PLC0415

    return migrate


def _init(args) -> int:
    _migrate().upgrade(args.db, "head")
    print(f"ledger at {args.db} is at revision {_migrate().current(args.db)}")
    return 0


def _current(args) -> int:
    check_sqlite_path(args.db)
    print(_migrate().current(args.db) or "(no schema)")
    return 0


def _upgrade(args) -> int:
    check_sqlite_path(args.db)
    _migrate().upgrade(args.db, args.revision)
    print(f"upgraded to {_migrate().current(args.db)}")
    return 0


def _downgrade(args) -> int:
    check_sqlite_path(args.db)
    _migrate().downgrade(args.db, args.revision)
    print(f"downgraded to {_migrate().current(args.db) or '(no schema)'}")
    return 0


def _verified(store, anchors: list):
    total = store.last_seq()
    with progress_bar(total, "verify") as update:
        seen = [0]

        def cumulative(done: int, _total: int | None = None) -> None:   # the store reports done-so-far
            update(done - seen[0])
            seen[0] = done

        return store.verify(progress=cumulative, anchors=anchors)


def _verify(args) -> int:
    anchors, _key = _anchors(args)
    with open_store(args.db) as store:
        report = _verified(store, anchors)
        if not report.ok:
            print(f"FAILED: {report.problem}", file=sys.stderr)
            return 1
        problems = []
        if report.checkpoints and not args.no_checkpoints:
            with progress_bar(report.num_events, "checkpoints") as update:
                problems = check_checkpoints(store, report.checkpoints, progress=update)
        if problems:
            print(f"FAILED: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                  file=sys.stderr)
            return 1
        older = older_checkpoints(report.checkpoints)
        print(f"ok: {report.num_events} events, seqs 1..{report.num_events} gapless, hash chain intact, "
              f"every payload decodes and matches its audit columns, "
              f"{len(report.checkpoints) - older} state checkpoints match replay"
              + (f" ({older} written by an earlier version of the fold, not compared)" if older else "")
              + (f", {len(anchors)} anchors agree" if anchors else ""))
        print(f"head {report.num_events}:{report.last_hash.hex()}")
    return 0


def _anchor(args) -> int:
    from residency.ledger import anchor  # noqa: PLC0415

    anchors, key = _anchors(args, create=True)
    with open_store(args.db) as store:
        report = _verified(store, anchors)
        if not report.ok:
            print(f"FAILED: {report.problem}; no anchor written", file=sys.stderr)
            return 1
        if report.num_events == 0:
            raise UserError("the ledger is empty: nothing to anchor")
        anchor.append(args.anchor, report.num_events, report.last_hash, key)
    print(f"anchored head {report.num_events}:{report.last_hash.hex()} in {args.anchor}"
          + ("" if key else " (no --anchor-key: the line is not keyed)"))
    return 0


def _export(args) -> int:
    with open_store(args.db) as store:
        if args.output == "-":
            n = store.export_jsonl(sys.stdout)
        else:
            with open(args.output, "w", encoding="utf-8") as fp:
                n = store.export_jsonl(fp)
    if args.output != "-":
        print(f"exported {n} events to {args.output}", file=sys.stderr)
    return 0


def _import(args) -> int:
    from residency.ledger import LedgerStore  # noqa: PLC0415

    try:
        fp = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read {args.input}: {e.strerror}") from e
    with fp:
        n = LedgerStore.import_jsonl(args.db, fp, create=True)     # a new ledger needs no `init` first
    print(f"imported {n} events into {args.db}; chain re-verified")
    return 0


def _snapshot(args) -> int:
    if args.every <= 0:
        raise UserError("--every must be positive")
    with open_store(args.db) as store:
        with progress_bar(store.last_seq(), "snapshot") as update:
            saved = write_snapshots(store, args.every, progress=update)
    print(f"saved snapshots at seqs {saved}" if saved else "ledger is empty: no snapshot")
    return 0
