"""`residency report -o report.html`: the ledger as one self-contained HTML page of plots.

The output is written to a temporary file beside the target and renamed into place only when
complete, so a failure (unwritable path, a ledger that is not one, --at beyond the end) leaves
nothing behind.
"""
from __future__ import annotations

import os
import tempfile

from residency.control.cli.common import add_db_arg, open_store
from residency.control.cli.diagnose_cmd import add_at_arg, add_param_args, params_from, read_events, resolve_at
from residency.control.cli.main import UserError
from residency.control.report import DEFAULT_BINS, build_report


def register(sub) -> None:
    p = sub.add_parser("report", help="write one self-contained HTML file with plots of the ledger and the findings")
    add_db_arg(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the HTML report")
    add_at_arg(p)
    p.add_argument("--bins", type=int, default=DEFAULT_BINS, metavar="N",
                   help=f"time resolution of the plots (default {DEFAULT_BINS})")
    add_param_args(p)
    p.set_defaults(func=run)


def check_writable(path: str) -> str:
    """The absolute target path, after checking it can be written; raises UserError naming why not."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise UserError(f"-o {path} is a directory; name a file, e.g. {os.path.join(path, 'report.html')}")
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise UserError(f"cannot write {path}: permission denied")
    return target


def write_atomically(target: str, text: str) -> None:
    folder = os.path.dirname(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html.tmp", dir=folder)
    except OSError as e:
        raise UserError(f"cannot write {target}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            fp.write(text)
        os.replace(tmp, target)
    except OSError as e:
        raise UserError(f"cannot write {target}: {e.strerror}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run(args) -> int:
    if args.bins < 10 or args.bins > 5000:
        raise UserError(f"--bins must be between 10 and 5000, got {args.bins}")
    params = params_from(args)
    target = check_writable(args.output)
    with open_store(args.db) as store:
        to_seq, at_ns = resolve_at(store, args.at)
        source = store.url
        html = build_report(read_events(store, to_seq, "report"), source, at_ns, params, args.bins)
    write_atomically(target, html)
    print(f"wrote {args.output} ({len(html) / 1e6:.1f} MB, {to_seq} events)")
    return 0
