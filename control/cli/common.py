"""Helpers shared by the CLI commands: the --db option, opening a store, times, progress bars."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from datetime import datetime, timezone

from residency.control.cli.main import UserError

DEFAULT_DB = "sqlite:///residency.db"


def add_db_arg(parser) -> None:
    parser.add_argument("--db", "--ledger", dest="db", default=os.environ.get("RESIDENCY_LEDGER", DEFAULT_DB),
                        help=f"ledger URL (default {DEFAULT_DB}; env RESIDENCY_LEDGER); "
                             "postgresql+psycopg://user@host/db for PostgreSQL")


def check_sqlite_path(url: str) -> None:
    """A read command on a SQLite file that does not exist must not create an empty one."""
    if url.startswith("sqlite:///") and ":memory:" not in url:
        path = url[len("sqlite:///"):]
        if not os.path.exists(path):
            raise UserError(f"no ledger at {path} (run `residency ledger init --db {url}` to create one)")


@contextmanager
def open_store(url: str, create: bool = False):
    from residency.ledger import LedgerStore  # noqa: PLC0415

    if not create:
        check_sqlite_path(url)
    store = LedgerStore.open(url, create=create)
    try:
        yield store
    finally:
        store.close()


def parse_time_ns(text: str) -> int:
    """ISO 8601 (a naive time is UTC) or integer nanoseconds since the epoch."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as e:
        raise UserError(f"not an ISO 8601 time: {text!r}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1e9)


@contextmanager
def progress_bar(total: int, desc: str, min_total: int = 200_000):
    """A tqdm bar on stderr for long work; silent for short work or when stderr is not a terminal."""
    if total < min_total or not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm  # noqa: PLC0415

    with tqdm(total=total, desc=desc, unit="ev", unit_scale=True, file=sys.stderr) as bar:
        yield bar.update
