"""events and snapshots tables; the events table is append-only.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Append-only is enforced by the database, not by politeness: triggers reject UPDATE and DELETE of
events rows on both backends, and TRUNCATE on PostgreSQL (statement-level triggers there, so an
UPDATE that matches no row is refused too). Dropping the table (a downgrade) is still possible.
Snapshots are a cache and stay deletable.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE_TRIGGERS = [
    """CREATE TRIGGER events_no_update BEFORE UPDATE ON events
       BEGIN SELECT RAISE(ABORT, 'events is append-only: UPDATE rejected'); END""",
    """CREATE TRIGGER events_no_delete BEFORE DELETE ON events
       BEGIN SELECT RAISE(ABORT, 'events is append-only: DELETE rejected'); END""",
]
_PG_TRIGGERS = [
    """CREATE FUNCTION residency_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         RAISE EXCEPTION 'events is append-only: % rejected', TG_OP USING ERRCODE = 'restrict_violation';
       END $$""",
    """CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
       FOR EACH STATEMENT EXECUTE FUNCTION residency_events_append_only()""",
    """CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
       FOR EACH STATEMENT EXECUTE FUNCTION residency_events_append_only()""",
]


def upgrade() -> None:
    seq_type = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "events",
        sa.Column("seq", seq_type, autoincrement=False, nullable=False),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("producer", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("producer_seq", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("schema_version", sa.SmallInteger(), nullable=False),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("causation", sa.Text(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("row_hash", sa.LargeBinary(), nullable=False),
        sa.Column("move_id", sa.Text(), nullable=True),
        sa.Column("worker", sa.BigInteger(), nullable=True),
        sa.Column("session", sa.Text(), nullable=True),
        sa.Column("tier", sa.Text(), nullable=True),
        sa.Column("kind", sa.Text(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.CheckConstraint("seq >= 1", name=op.f("ck_events_seq_positive")),
        sa.CheckConstraint("length(row_hash) = 32", name=op.f("ck_events_row_hash_32_bytes")),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_events")),
    )
    op.create_index("ix_events_producer_epoch_producer_seq", "events", ["producer", "epoch", "producer_seq"], unique=True)
    op.create_index("ix_events_ts_ns", "events", ["ts_ns"])
    op.create_index("ix_events_move_id", "events", ["move_id"],
                    sqlite_where=sa.text("move_id IS NOT NULL"), postgresql_where=sa.text("move_id IS NOT NULL"))
    op.create_index("ix_events_session", "events", ["session"],
                    sqlite_where=sa.text("session IS NOT NULL"), postgresql_where=sa.text("session IS NOT NULL"))
    op.create_table(
        "snapshots",
        sa.Column("through_seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("state_hash", sa.Text(), nullable=False),
        sa.Column("state_bytes", sa.LargeBinary(), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("through_seq", name=op.f("pk_snapshots")),
    )
    for ddl in _SQLITE_TRIGGERS if op.get_bind().dialect.name == "sqlite" else _PG_TRIGGERS:
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS events_no_delete")
        op.execute("DROP TRIGGER IF EXISTS events_no_update")
    else:
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_no_update_delete ON events")
        op.execute("DROP FUNCTION IF EXISTS residency_events_append_only()")
    op.drop_table("snapshots")
    op.drop_index("ix_events_session", table_name="events")
    op.drop_index("ix_events_move_id", table_name="events")
    op.drop_index("ix_events_ts_ns", table_name="events")
    op.drop_index("ix_events_producer_epoch_producer_seq", table_name="events")
    op.drop_table("events")
