"""The ledger: Residency's append-only, hash-chained event store (SQLite or PostgreSQL).

    store = LedgerStore.open("sqlite:///residency.db")      # or postgresql+psycopg://...
    store.append([(envelope, event)])                       # -> [seq]
    GroupCommitWriter(store).submit(envelope, event)        # -> Future[seq], batched commits
    store.verify()                                          # -> VerifyReport

Modules, one role each: errors (the exception tree), schema (tables), backend (engines and
SQLite/PostgreSQL differences), chain (row hashes), columns (audit columns), append (numbering
and idempotence), store (LedgerStore), writer (group commit), snapshots, verify, export (JSON
lines), migrate (Alembic, programmatically). Imports events/ and nothing else of ours.
"""
from ledger.errors import LedgerConflict, LedgerCorrupt, LedgerError, LedgerUnavailable, NotALedger, SchemaOutOfDate
from ledger.schema import RawRow, Snapshot
from ledger.store import LedgerStore
from ledger.verify import VerifyReport
from ledger.writer import GroupCommitWriter

__all__ = [
    "LedgerStore", "GroupCommitWriter", "VerifyReport", "RawRow", "Snapshot",
    "LedgerError", "LedgerUnavailable", "NotALedger", "LedgerCorrupt", "LedgerConflict", "SchemaOutOfDate",
]
