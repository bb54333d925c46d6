"""The audit views read CopiesReleased, a release's own answer.

Revision ID: 0004
Revises: 0003

A release used to be answered by two rows: ``MoveAcked`` (nothing moved, nothing freed) then
``BlocksFreed(reason="release")`` with the bytes the worker measured. It is now one
``CopiesReleased`` row (audit columns: move_id = the release, tier, kind = 'release', bytes as
measured). Both forms stay in ledgers, so the views read both:

residency_reclaimed  as 0002, plus one row per CopiesReleased (cause = 'release', session NULL,
    as the BlocksFreed row of the older form had): a ledger reclaims the same bytes per tier,
    worker, session and cause whichever form recorded its releases.
residency_stranded   as 0002, and a stranding is also resolved by a later CopiesReleased of the
    same move_id (a release answered after its deadline), looked up by its own partial index.

No row changes; downgrade restores the 0002 views and drops the index.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RECLAIMED = """
CREATE VIEW residency_reclaimed AS
SELECT a.seq AS seq, a.ts_ns AS ts_ns, a.worker AS worker, r.tier AS tier, r.kind AS cause,
       r.session AS session, a.move_id AS move_id, a.bytes AS bytes
  FROM events a
  LEFT JOIN events r ON r.move_id = a.move_id AND r.type = 'MoveRequested'
 WHERE a.type IN ('MoveAcked', 'MoveLateAcked')
UNION ALL
SELECT f.seq, f.ts_ns, f.worker, f.tier, f.kind, f.session, f.move_id, f.bytes
  FROM events f
 WHERE f.type IN ('BlocksFreed', 'CopiesReleased')
"""

STRANDED = """
CREATE VIEW residency_stranded AS
SELECT s.seq AS seq, s.ts_ns AS ts_ns, s.worker AS worker, r.tier AS tier, r.session AS session,
       s.move_id AS move_id, s.kind AS why, CAST(NULL AS TEXT) AS detail, s.bytes AS bytes
  FROM events s
  LEFT JOIN events r ON r.move_id = s.move_id AND r.type = 'MoveRequested'
 WHERE s.type = 'MoveStranded'
   AND NOT EXISTS (SELECT 1 FROM events l
                    WHERE l.move_id = s.move_id AND l.type = 'MoveLateAcked' AND l.seq > s.seq)
   AND NOT EXISTS (SELECT 1 FROM events c
                    WHERE c.move_id = s.move_id AND c.type = 'CopiesReleased' AND c.seq > s.seq)
UNION ALL
SELECT w.seq, w.ts_ns, w.worker, CAST(NULL AS TEXT), CAST(NULL AS TEXT), CAST(NULL AS TEXT),
       'blocks_lost', w.kind, w.bytes
  FROM events w
 WHERE w.type = 'WorkerLost'
"""


# the 0002 views, as downgrade restores them (a migration keeps its own copy: 0002 never changes)
OLD_RECLAIMED = """
CREATE VIEW residency_reclaimed AS
SELECT a.seq AS seq, a.ts_ns AS ts_ns, a.worker AS worker, r.tier AS tier, r.kind AS cause,
       r.session AS session, a.move_id AS move_id, a.bytes AS bytes
  FROM events a
  LEFT JOIN events r ON r.move_id = a.move_id AND r.type = 'MoveRequested'
 WHERE a.type IN ('MoveAcked', 'MoveLateAcked')
UNION ALL
SELECT f.seq, f.ts_ns, f.worker, f.tier, f.kind, f.session, f.move_id, f.bytes
  FROM events f
 WHERE f.type = 'BlocksFreed'
"""

OLD_STRANDED = """
CREATE VIEW residency_stranded AS
SELECT s.seq AS seq, s.ts_ns AS ts_ns, s.worker AS worker, r.tier AS tier, r.session AS session,
       s.move_id AS move_id, s.kind AS why, CAST(NULL AS TEXT) AS detail, s.bytes AS bytes
  FROM events s
  LEFT JOIN events r ON r.move_id = s.move_id AND r.type = 'MoveRequested'
 WHERE s.type = 'MoveStranded'
   AND NOT EXISTS (SELECT 1 FROM events l
                    WHERE l.move_id = s.move_id AND l.type = 'MoveLateAcked' AND l.seq > s.seq)
UNION ALL
SELECT w.seq, w.ts_ns, w.worker, CAST(NULL AS TEXT), CAST(NULL AS TEXT), CAST(NULL AS TEXT),
       'blocks_lost', w.kind, w.bytes
  FROM events w
 WHERE w.type = 'WorkerLost'
"""


def _drop_views() -> None:
    op.execute("DROP VIEW IF EXISTS residency_stranded")
    op.execute("DROP VIEW IF EXISTS residency_reclaimed")


def upgrade() -> None:
    where = sa.text("type = 'CopiesReleased'")
    op.create_index("ix_events_copies_released", "events", ["move_id"], sqlite_where=where, postgresql_where=where)
    _drop_views()
    op.execute(RECLAIMED)
    op.execute(STRANDED)


def downgrade() -> None:
    _drop_views()
    op.execute(OLD_RECLAIMED)
    op.execute(OLD_STRANDED)
    op.drop_index("ix_events_copies_released", table_name="events")
