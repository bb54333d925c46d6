"""Close two ways around the append-only guard, and bind snapshots to the chain.

Revision ID: 0006
Revises: 0005

1. SQLite: ``INSERT OR REPLACE`` (and ``REPLACE``) settles a key conflict by deleting the stored
   row, and SQLite fires no DELETE trigger for that delete unless ``recursive_triggers`` is on,
   which is a setting of the connection doing it, not of the database. A BEFORE INSERT trigger
   that refuses a row whose seq, or whose (producer, epoch, producer_seq), is already stored
   runs before any conflict resolution, so no conflict clause can get past it.
   PostgreSQL needs nothing: ``INSERT ... ON CONFLICT DO UPDATE`` fires the statement-level
   UPDATE trigger 0001 installed, and there is no REPLACE.
2. ``snapshots.checkpoint_seq``: the seq of the ``StateCheckpoint`` event that records the
   snapshot's state hash. A snapshot is used only when that event, inside the hash chain, names
   the snapshot's seq and hash (``ledger.snapshots``). Rows saved before this revision have none
   and are ignored until a new snapshot replaces them.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

NO_REPLACE = """CREATE TRIGGER events_no_replace BEFORE INSERT ON events
WHEN EXISTS (SELECT 1 FROM events WHERE seq = NEW.seq)
  OR EXISTS (SELECT 1 FROM events WHERE producer = NEW.producer AND epoch = NEW.epoch
                                     AND producer_seq = NEW.producer_seq)
BEGIN SELECT RAISE(ABORT, 'events is append-only: INSERT over a stored seq or producer triple rejected'); END"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(NO_REPLACE)
    with op.batch_alter_table("snapshots") as batch:
        batch.add_column(sa.Column("checkpoint_seq", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("checkpoint_seq")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS events_no_replace")
