"""The ledger: Residency's append-only, hash-chained event store (SQLite or PostgreSQL).

    store = LedgerStore.open("sqlite:///residency.db")      # or postgresql+psycopg://...
    store.append([(envelope, event)])                       # -> [seq]
    GroupCommitWriter(store).submit(envelope, event)        # -> Future[seq], batched commits
    store.verify()                                          # -> VerifyReport

Modules, one role each: errors (the exception tree), schema (tables), backend (engines and
SQLite/PostgreSQL differences), chain (row hashes), columns (audit columns), append (numbering
and idempotence), store (LedgerStore), writer (group commit), snapshots, verify, export (JSON
lines), migrate (Alembic, programmatically), anchor (heads kept outside the database). Imports events/ and nothing else of ours.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from residency.ledger.errors import LedgerConflict, LedgerCorrupt, LedgerError, LedgerUnavailable, NotALedger, SchemaOutOfDate
    from residency.ledger.schema import RawRow, Snapshot
    from residency.ledger.store import LedgerStore
    from residency.ledger.verify import VerifyReport
    from residency.ledger.writer import GroupCommitWriter

# NOTE: the names below load on first use (PEP 562), so a process that needs only a leaf module
# (a verify worker: ledger.verify over plain sqlite3) does not pay for SQLAlchemy and Alembic.
_EXPORTS = {
    "LedgerStore": "residency.ledger.store", "GroupCommitWriter": "residency.ledger.writer", "VerifyReport": "residency.ledger.verify",
    "RawRow": "residency.ledger.schema", "Snapshot": "residency.ledger.schema",
    **{name: "residency.ledger.errors" for name in ("LedgerError", "LedgerUnavailable", "NotALedger", "LedgerCorrupt",
                                           "LedgerConflict", "SchemaOutOfDate")},
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
