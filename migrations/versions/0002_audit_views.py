"""Audit views: residency_reclaimed and residency_stranded.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Plain SQL over the denormalized columns (ledger.columns), the same text on SQLite and PostgreSQL.
They answer the audit definitions of docs/operators.md (reclaimed and stranded bytes) exactly:

residency_reclaimed  one row per reclaim, bytes as reported by a worker, never from a plan:
    MoveAcked / MoveLateAcked .bytes_freed_src, with tier (the move's src), cause (the move
    kind) and session taken from the MoveRequested of the same move_id; plus BlocksFreed.bytes
    with cause = the free reason. Acks that freed 0 bytes are kept: a reported 0 is an accounting.
residency_stranded   MoveStranded.bytes_at_risk not resolved by a later MoveLateAcked of the same
    move_id (why = deadline | worker_lost | silent_release), plus one row per WorkerLost with the
    bytes that were only on that worker (why = 'blocks_lost', detail = the loss reason).
"""
from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
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
 WHERE f.type = 'BlocksFreed'
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
UNION ALL
SELECT w.seq, w.ts_ns, w.worker, CAST(NULL AS TEXT), CAST(NULL AS TEXT), CAST(NULL AS TEXT),
       'blocks_lost', w.kind, w.bytes
  FROM events w
 WHERE w.type = 'WorkerLost'
"""


def upgrade() -> None:
    op.execute(RECLAIMED)
    op.execute(STRANDED)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS residency_stranded")
    op.execute("DROP VIEW IF EXISTS residency_reclaimed")
