"""Snapshots: the folded state at a seq, so replay of a long ledger starts from the nearest one.

A snapshot is a cache, never the truth. The ledger stores the bytes and hash control hands it and
does not interpret them (control owns the state format and checks ``state_hash`` against the
decoded state). Deleting snapshots is always safe (the table has no append-only trigger); saving
one at a seq that already has one replaces it.

Because the table can be rewritten (it is a cache), a snapshot row proves nothing by itself: a
forger can store any state with its own correct hash. So every snapshot names the
``StateCheckpoint`` event that recorded its hash (``checkpoint_seq``), and is used only when

    that row is in the ledger, is a StateCheckpoint, still chains from the row before it, and
    names the snapshot's through_seq and state_hash

(``vouch``). Forging a snapshot then means forging an event inside the hash chain, which
``ledger verify`` catches (it replays to every StateCheckpoint and compares), as it does any
other edit. A snapshot the chain does not vouch for comes back with ``refused`` set, naming its
seq; the caller folds from the events instead.
"""
from __future__ import annotations

import time

from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Connection

from residency.events import DecodeError, decode_event
from residency.ledger.chain import GENESIS, row_hash
from residency.ledger.errors import LedgerConflict
from residency.ledger.schema import RAW_COLUMNS, Snapshot, events, snapshots


def save(conn: Connection, through_seq: int, state_bytes: bytes, state_hash: str, checkpoint_seq: int) -> None:
    """Store (or replace) the snapshot at ``through_seq``, vouched for by the StateCheckpoint at
    ``checkpoint_seq``; raises LedgerConflict past the end or when that event does not vouch for it."""
    if not isinstance(through_seq, int) or through_seq < 0:
        raise ValueError(f"through_seq must be an int >= 0, got {through_seq!r}")
    last = conn.execute(select(func.coalesce(func.max(events.c.seq), 0))).scalar_one()
    if through_seq > last:
        raise LedgerConflict(f"a snapshot through seq {through_seq} is past the end of the ledger (last seq {last})")
    problem = vouch(conn, through_seq, state_hash, checkpoint_seq)
    if problem is not None:
        raise LedgerConflict(f"cannot save the snapshot through seq {through_seq}: {problem}")
    conn.execute(delete(snapshots).where(snapshots.c.through_seq == through_seq))
    conn.execute(insert(snapshots).values(through_seq=through_seq, state_bytes=bytes(state_bytes),
                                          state_hash=state_hash, created_ns=time.time_ns(),
                                          checkpoint_seq=checkpoint_seq))


def load(conn: Connection, at_or_before_seq: int) -> Snapshot | None:
    """The latest snapshot with ``through_seq <= at_or_before_seq``, or None; ``refused`` says
    why the chain does not vouch for it (None: it does)."""
    row = conn.execute(
        select(snapshots.c.through_seq, snapshots.c.state_bytes, snapshots.c.state_hash, snapshots.c.checkpoint_seq)
        .where(snapshots.c.through_seq <= at_or_before_seq)
        .order_by(snapshots.c.through_seq.desc()).limit(1)
    ).first()
    if row is None:
        return None
    problem = vouch(conn, row[0], row[2], row[3])
    refused = None if problem is None else f"the snapshot through seq {row[0]} is refused: {problem}"
    return Snapshot(row[0], bytes(row[1]), row[2], row[3], refused)


def vouch(conn: Connection, through_seq: int, state_hash: str, checkpoint_seq: int | None) -> str | None:
    """None when the StateCheckpoint at ``checkpoint_seq`` vouches for (through_seq, state_hash);
    otherwise why not, naming the seqs."""
    if checkpoint_seq is None:
        return "it names no StateCheckpoint event (saved before snapshots were bound to the chain)"
    if not isinstance(checkpoint_seq, int) or checkpoint_seq <= through_seq:
        return f"its StateCheckpoint seq {checkpoint_seq!r} is not after its own seq"
    cols = [events.c[name] for name in RAW_COLUMNS]
    rows = conn.execute(select(*cols).where(events.c.seq.between(checkpoint_seq - 1, checkpoint_seq))
                        .order_by(events.c.seq)).all()
    if not rows or rows[-1][0] != checkpoint_seq:
        return f"seq {checkpoint_seq}, the StateCheckpoint it names, is not in the ledger"
    row = tuple(rows[-1])
    prev = GENESIS if checkpoint_seq == 1 else (bytes(rows[0][10]) if len(rows) == 2 else None)
    if prev is None or row_hash(prev, row) != bytes(row[10]):
        return f"seq {checkpoint_seq}, the StateCheckpoint it names, does not chain from the row before it"
    if row[5] != "StateCheckpoint":
        return f"seq {checkpoint_seq} is a {row[5]}, not a StateCheckpoint"
    try:
        event = decode_event(bytes(row[9]), row[5], row[6])
    except DecodeError as e:
        return f"seq {checkpoint_seq} does not decode: {e}"
    if event.through_seq != through_seq or event.state_hash != state_hash:
        return (f"the StateCheckpoint at seq {checkpoint_seq} records state hash {event.state_hash[:16]}… "
                f"through seq {event.through_seq}, not {state_hash[:16]}… through seq {through_seq}")
    return None
