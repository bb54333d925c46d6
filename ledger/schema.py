"""The ledger's tables as SQLAlchemy Core metadata: the model Alembic migrations must match.

Only Alembic creates these tables (``migrations/versions``); this metadata is what
``compare_metadata`` checks the migrations against, and what Core queries are built from.

events      one row per event, never updated or deleted (database triggers enforce it)
snapshots   folded state at a seq: a cache for fast replay, safe to delete; used only when
            the StateCheckpoint at ``checkpoint_seq`` (in the chain) names its seq and hash

NOTE: ``seq`` is ``INTEGER PRIMARY KEY`` on SQLite on purpose: that makes it the rowid itself,
so there is no second B-tree for the primary key (bytes on disk per event, see bench/ledger.py).
"""
from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import (
    BigInteger, CheckConstraint, Column, Index, Integer, LargeBinary, MetaData, SmallInteger, Table, Text, text,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING)

# A rowid alias on SQLite, a BIGINT everywhere else.
SeqType = BigInteger().with_variant(Integer(), "sqlite")

events = Table(
    "events", metadata,
    Column("seq", SeqType, primary_key=True, autoincrement=False),
    Column("ts_ns", BigInteger, nullable=False),
    Column("producer", Text, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("producer_seq", BigInteger, nullable=False),
    Column("type", Text, nullable=False),
    Column("schema_version", SmallInteger, nullable=False),
    Column("correlation_id", Text),
    Column("causation", Text),
    Column("payload", LargeBinary, nullable=False),
    Column("row_hash", LargeBinary, nullable=False),
    # denormalized audit columns (ledger.columns), not hashed
    Column("move_id", Text),
    Column("worker", BigInteger),
    Column("session", Text),
    Column("tier", Text),
    Column("kind", Text),
    Column("bytes", BigInteger),
    CheckConstraint("seq >= 1", name="seq_positive"),
    CheckConstraint("length(row_hash) = 32", name="row_hash_32_bytes"),
)
Index("ix_events_producer_epoch_producer_seq", events.c.producer, events.c.epoch, events.c.producer_seq, unique=True)
Index("ix_events_ts_ns", events.c.ts_ns)
# The move and loss lookups of the audit views, and no more (migrations 0003 to 0005 say why).
Index("ix_events_move_requested", events.c.move_id,
      sqlite_where=text("type = 'MoveRequested'"), postgresql_where=text("type = 'MoveRequested'"))
Index("ix_events_move_late_acked", events.c.move_id,
      sqlite_where=text("type = 'MoveLateAcked'"), postgresql_where=text("type = 'MoveLateAcked'"))
Index("ix_events_copies_released", events.c.move_id,
      sqlite_where=text("type = 'CopiesReleased'"), postgresql_where=text("type = 'CopiesReleased'"))
Index("ix_events_move_late_failed", events.c.move_id,
      sqlite_where=text("type = 'MoveLateFailed'"), postgresql_where=text("type = 'MoveLateFailed'"))
Index("ix_events_worker_lost", events.c.worker,
      sqlite_where=text("type = 'WorkerLost'"), postgresql_where=text("type = 'WorkerLost'"))

snapshots = Table(
    "snapshots", metadata,
    Column("through_seq", BigInteger, primary_key=True, autoincrement=False),
    Column("state_hash", Text, nullable=False),
    Column("state_bytes", LargeBinary, nullable=False),
    Column("created_ns", BigInteger, nullable=False),
    # the StateCheckpoint event that vouches for state_hash (ledger.snapshots); NULL: saved before 0006
    Column("checkpoint_seq", BigInteger),
)

# Column order of an INSERT into events and of RawRow (the first ten are the hashed ones).
EVENT_COLUMNS = (
    "seq", "ts_ns", "producer", "epoch", "producer_seq", "type", "schema_version",
    "correlation_id", "causation", "payload", "row_hash",
    "move_id", "worker", "session", "tier", "kind", "bytes",
)
RAW_COLUMNS = EVENT_COLUMNS[:11]
VIEWS = ("residency_reclaimed", "residency_stranded")


class RawRow(NamedTuple):
    """An undecoded events row, as stored (what verify and export read)."""

    seq: int
    ts_ns: int
    producer: str
    epoch: int
    producer_seq: int
    type: str
    schema_version: int
    correlation_id: str | None
    causation: str | None
    payload: bytes
    row_hash: bytes


class PayloadRun(NamedTuple):
    """A gapless run of events rows, only what a fold needs: ``rows[i]`` is seq ``first_seq + i``.

    What replay reads (``LedgerStore.payload_runs``): three columns per row instead of eleven,
    each row a plain tuple ``(type, schema_version, payload)`` as the driver returns it.
    """

    first_seq: int
    last_ts_ns: int                  # ts_ns of the run's last row
    rows: list[tuple[str, int, bytes]]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.rows) - 1


class PackedRun(NamedTuple):
    """A gapless run of events rows, every one at its type's current schema version, packed by
    the database (``LedgerStore.packed_runs``): row i is seq ``first_seq + i``;
    ``events.codec.decode_packed`` takes the last four fields."""

    first_seq: int
    last_ts_ns: int                  # ts_ns of the run's last row
    num_rows: int
    payloads: bytes                  # every row's payload, back to back, in seq order
    types: str                       # the rows' types, joined by ","
    lengths: str                     # len(payload) of each row, joined by ", "

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.num_rows - 1


class Snapshot(NamedTuple):
    through_seq: int
    state_bytes: bytes
    state_hash: str
    checkpoint_seq: int | None = None     # the StateCheckpoint that vouches for state_hash
    refused: str | None = None            # why the chain does not vouch for it (then do not use it)
