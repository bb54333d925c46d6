"""A byte is stranded once: a stranding on a worker lost later is counted by the loss.

Revision ID: 0005
Revises: 0004

When a worker is lost, its ``WorkerLost`` row carries the bytes of every block that was on it
(``bytes_lost``; the disk copies its next incarnation verified are kept, not lost). The moves of
that worker that were stranded before the loss, or in flight at it (stranded right after it,
why = 'worker_lost'), named blocks among those: before this revision residency_stranded counted
their bytes a second time. Now a stranding counts only while no ``WorkerLost`` of its worker
follows the move's ``MoveRequested``; the loss's row counts the bytes. The fold does the same
(``control.state.LOST``), so the view, replay and the metric agree, on old ledgers too: rows are
not rewritten, the view reads them this way.

residency_stranded   as 0004, less the strandings whose worker was lost after their move was
    requested; the loss is looked up by its own partial index (worker WHERE type = 'WorkerLost').
    A stranding is also resolved by a later ``MoveLateFailed`` of its move (the worker answered
    that it never landed: rejected past its deadline, failed), by its own partial index.
residency_reclaimed  unchanged.

Downgrade restores the 0004 view and drops the two indexes.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

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
   AND NOT EXISTS (SELECT 1 FROM events f
                    WHERE f.move_id = s.move_id AND f.type = 'MoveLateFailed' AND f.seq > s.seq)
   AND NOT EXISTS (SELECT 1 FROM events w
                    WHERE w.worker = s.worker AND w.type = 'WorkerLost' AND w.seq > COALESCE(r.seq, s.seq))
UNION ALL
SELECT w.seq, w.ts_ns, w.worker, CAST(NULL AS TEXT), CAST(NULL AS TEXT), CAST(NULL AS TEXT),
       'blocks_lost', w.kind, w.bytes
  FROM events w
 WHERE w.type = 'WorkerLost'
"""

# the 0004 view, as downgrade restores it (a migration keeps its own copy)
OLD_STRANDED = """
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


def upgrade() -> None:
    where = sa.text("type = 'WorkerLost'")
    op.create_index("ix_events_worker_lost", "events", ["worker"], sqlite_where=where, postgresql_where=where)
    where = sa.text("type = 'MoveLateFailed'")
    op.create_index("ix_events_move_late_failed", "events", ["move_id"], sqlite_where=where, postgresql_where=where)
    op.execute("DROP VIEW IF EXISTS residency_stranded")
    op.execute(STRANDED)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS residency_stranded")
    op.execute(OLD_STRANDED)
    op.drop_index("ix_events_move_late_failed", table_name="events")
    op.drop_index("ix_events_worker_lost", table_name="events")
