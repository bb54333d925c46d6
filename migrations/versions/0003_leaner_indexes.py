"""Leaner indexes: only the lookups the ledger and its audit views make (bytes on disk per event).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

Before (0001): ix_events_move_id over every row that names a move, ix_events_session over every
row that names a session. Nothing of ours looks rows up by session (the audit views group by it,
the timeline reads the ledger in order), and the audit views look moves up in exactly two ways:
the MoveRequested of a move (its tier, kind, session) and whether a MoveLateAcked followed its
stranding. So:

    dropped   ix_events_session
    replaced  ix_events_move_id  ->  ix_events_move_requested  (move_id) WHERE type = 'MoveRequested'
                                     ix_events_move_late_acked (move_id) WHERE type = 'MoveLateAcked'

The views' query plans still use an index for every lookup (tests/migrations checks the SQLite
plan). An auditor's own ``WHERE move_id = ?`` or ``WHERE session = ?`` now scans the table
(about a second per ten million rows on SQLite), which is the trade this revision makes: about
25 bytes per event on SQLite. PostgreSQL: the indexes that only ever grow at their right edge
(the primary key and ts_ns) are rebuilt with fillfactor 100, since no page of theirs will
ever take another row; the default 90 leaves a tenth of each page empty for nothing.

No row changes: the hash chain, triggers, views and payloads are as they were. Downgrade rebuilds
the 0001 indexes (and fillfactors) from the rows.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_FULL_PAGES = ("pk_events", "ix_events_ts_ns")     # PostgreSQL: append-only keys


def _partial(name: str, type_name: str) -> None:
    where = sa.text(f"type = '{type_name}'")
    op.create_index(name, "events", ["move_id"], sqlite_where=where, postgresql_where=where)


def upgrade() -> None:
    op.drop_index("ix_events_session", table_name="events")
    op.drop_index("ix_events_move_id", table_name="events")
    _partial("ix_events_move_requested", "MoveRequested")
    _partial("ix_events_move_late_acked", "MoveLateAcked")
    if op.get_bind().dialect.name == "postgresql":
        for index in _FULL_PAGES:
            op.execute(f"ALTER INDEX {index} SET (fillfactor = 100)")
            op.execute(f"REINDEX INDEX {index}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for index in _FULL_PAGES:
            op.execute(f"ALTER INDEX {index} RESET (fillfactor)")
            op.execute(f"REINDEX INDEX {index}")
    op.drop_index("ix_events_move_late_acked", table_name="events")
    op.drop_index("ix_events_move_requested", table_name="events")
    op.create_index("ix_events_move_id", "events", ["move_id"],
                    sqlite_where=sa.text("move_id IS NOT NULL"), postgresql_where=sa.text("move_id IS NOT NULL"))
    op.create_index("ix_events_session", "events", ["session"],
                    sqlite_where=sa.text("session IS NOT NULL"), postgresql_where=sa.text("session IS NOT NULL"))
