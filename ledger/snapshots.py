"""Snapshots: the folded state at a seq, so replay of a long ledger starts from the nearest one.

A snapshot is a cache, never the truth: the ledger stores the bytes and hash control hands it
and does not interpret them (control owns the state format and checks ``state_hash`` against
its fold). Deleting snapshots is always safe (the table has no append-only trigger); saving one
at a seq that already has one replaces it.
"""
from __future__ import annotations

import time

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Connection

from residency.ledger.errors import LedgerConflict
from residency.ledger.schema import Snapshot, events, snapshots


def save(conn: Connection, through_seq: int, state_bytes: bytes, state_hash: str) -> None:
    """Store (or replace) the snapshot at ``through_seq``; raises LedgerConflict past the end."""
    if not isinstance(through_seq, int) or through_seq < 0:
        raise ValueError(f"through_seq must be an int >= 0, got {through_seq!r}")
    last = conn.execute(select(func.coalesce(func.max(events.c.seq), 0))).scalar_one()
    if through_seq > last:
        raise LedgerConflict(f"a snapshot through seq {through_seq} is past the end of the ledger (last seq {last})")
    conn.execute(delete(snapshots).where(snapshots.c.through_seq == through_seq))
    conn.execute(insert(snapshots).values(through_seq=through_seq, state_bytes=bytes(state_bytes),
                                          state_hash=state_hash, created_ns=time.time_ns()))


def load(conn: Connection, at_or_before_seq: int) -> Snapshot | None:
    """The latest snapshot with ``through_seq <= at_or_before_seq``, or None."""
    row = conn.execute(
        select(snapshots.c.through_seq, snapshots.c.state_bytes, snapshots.c.state_hash)
        .where(snapshots.c.through_seq <= at_or_before_seq)
        .order_by(snapshots.c.through_seq.desc()).limit(1)
    ).first()
    return None if row is None else Snapshot(row[0], bytes(row[1]), row[2])
