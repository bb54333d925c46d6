"""Appending: encode outside the lock, then number, chain and insert inside it.

    prepare(items)                   no lock: payload bytes, type, schema version, audit columns
    write(cur, dialect, rows, tail)  inside the write transaction (see Dialect.begin_write):
        1. the tail (last seq, last hash): remembered from this writer's last commit, else read
        2. look up any (producer, epoch, producer_seq) already stored     -> idempotent retries;
           skipped when every triple is beyond what this writer has seen stored
        3. seq = last+1, +2, ... in item order; hash chained from the tail
        4. one executemany (SQLite) or COPY (PostgreSQL) of pre-built tuples

Idempotence: the triple names a fact. A retry of a stored triple (or a repeat inside one batch)
gets the stored seq back and writes nothing; a retry whose type or payload differs is a
``LedgerConflict`` and the whole batch is rolled back. ``envelope.seq`` is ignored on input.

NOTE: what the writer remembers (``Tail``) is a guess the database checks, never a fact it
trusts. Another writer (a second store, another process, a tool writing plain SQL) may append
between two of our commits. Then the remembered tail is behind the real one, and the first seq
we number (remembered + 1) is already stored: the primary key refuses the insert. A triple
another writer stored, that we did not look up, is refused by the unique index on the triple.
Either way ``write`` raises ``StaleTail``; the caller rolls back and writes again with the tail
forgotten, which reads the tail and looks every triple up, as a writer that remembers nothing
does. Rows are never deleted (triggers), so a tail that is behind always collides.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec

from residency.events import Envelope, decode_event
from residency.events.catalog import EVENT_TYPES, Event
from residency.ledger.chain import GENESIS
from residency.ledger.columns import extractor
from residency.ledger.errors import LedgerConflict

_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256
# class -> (type name, schema version, audit-column extractor): one lookup per event
_INFO = {cls: (name, cls.SCHEMA_VERSION, extractor(cls)) for name, cls in EVENT_TYPES.items()}

# A prepared row: (ts_ns, producer, epoch, producer_seq, type, schema_version, correlation_id,
#                  causation, payload, columns)
Prepared = tuple


def prepare(items: Sequence[tuple[Envelope, Event]]) -> list[Prepared]:
    out = []
    append, enc, info_of = out.append, _encode, _INFO.get
    for item in items:
        env, ev = item
        info = info_of(type(ev))
        if info is None:
            raise TypeError(f"not an event from events.catalog: {type(ev).__name__}")
        if type(env) is not Envelope:
            raise TypeError(f"not an events.Envelope: {type(env).__name__}")
        append((env.ts_ns, env.producer, env.epoch, env.producer_seq, info[0], info[1],
                env.correlation_id, env.causation, enc(ev), info[2](ev)))
    return out


def read_tail(cur) -> tuple[int, bytes]:
    cur.execute("SELECT seq, row_hash FROM events ORDER BY seq DESC LIMIT 1")
    row = cur.fetchone()
    return (0, GENESIS) if row is None else (row[0], bytes(row[1]))


def _ranges(prepared: list[Prepared]) -> tuple[dict[tuple, list[int]], bool]:
    """Per (producer, epoch): [lowest, highest] producer_seq in the batch; and whether each
    producer's seqs strictly increase through the batch (then no triple can repeat in it)."""
    ranges: dict[tuple, list[int]] = {}
    increasing = True
    for p in prepared:
        r = ranges.get((p[1], p[2]))
        if r is None:
            ranges[(p[1], p[2])] = [p[3], p[3]]
        elif p[3] > r[1]:
            r[1] = p[3]
        else:
            increasing = False
            if p[3] < r[0]:
                r[0] = p[3]
    return ranges, increasing


def _stored(cur, dialect, ranges: dict[tuple, list[int]]) -> dict[tuple, tuple]:
    """Already-stored rows among the batch's triples: triple -> (seq, type, schema_version, payload).

    One range query per (producer, epoch) in the batch, on the unique index: in normal operation
    (new producer_seqs above everything stored) each returns nothing at the cost of one seek.
    """
    found: dict[tuple, tuple] = {}
    sql = ("SELECT producer_seq, seq, type, schema_version, payload FROM events "
           f"WHERE producer = {dialect.p} AND epoch = {dialect.p} AND producer_seq BETWEEN {dialect.p} AND {dialect.p}")
    for (producer, epoch), (lo, hi) in ranges.items():
        for pseq, seq, type_, version, payload in dialect.fetchall(cur, sql, (producer, epoch, lo, hi)):
            found[(producer, epoch, pseq)] = (seq, type_, version, bytes(payload))
    return found


def _same(stored: tuple, p: Prepared) -> bool:
    _seq, type_, version, payload = stored
    if type_ != p[4]:
        return False
    if version == p[5]:
        return payload == p[8]
    try:  # stored under an older schema: compare as events
        return decode_event(payload, type_, version) == decode_event(p[8], p[4], p[5])
    except Exception:
        return False


def _conflict(p: Prepared, stored: tuple) -> LedgerConflict:
    return LedgerConflict(
        f"{p[1]} epoch {p[2]} producer_seq {p[3]} is already seq {stored[0]} ({stored[1]}) "
        f"and the retry carries a different {p[4]} payload")


def chain(prepared: list[Prepared], seq: int, prev: bytes) -> list[tuple]:
    """Full rows for ``prepared`` numbered from ``seq + 1`` and chained from ``prev`` (the hot loop)."""
    rows: list[tuple] = []
    append, sha, enc = rows.append, _sha256, _encode
    for p in prepared:
        seq += 1
        canon = (seq, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8])
        h = sha(prev)
        h.update(enc(canon))
        prev = h.digest()
        append(canon + (prev,) + p[9])
    return rows


class StaleTail(Exception):
    """The database refused a batch numbered from the remembered tail, or a triple this writer
    did not look up: another writer appended meanwhile. Roll back and write again (the tail is
    forgotten). Never leaves the ledger package."""


class Tail:
    """What one writer remembers of the ledger between its commits (guarded by its write lock).

        seq, hash   the last row after this writer's last commit; seq None: not known, read it
        high        per (producer, epoch), the highest producer_seq known to be stored

    ``write`` stages what a commit will make true (``staged``); ``committed()`` makes it what is
    remembered, ``forget()`` (any failure, any rollback) drops the tail. ``high`` is only ever
    a lower bound of what is stored, so it is kept across failures.
    """

    MAX_PRODUCERS = 4096      # (producer, epoch) pairs remembered; past that, forget them all (it only costs lookups)

    __slots__ = ("seq", "hash", "high", "staged")

    def __init__(self) -> None:
        self.seq: int | None = None
        self.hash: bytes = GENESIS
        self.high: dict[tuple, int] = {}
        self.staged: tuple | None = None

    def forget(self) -> None:
        self.seq, self.hash, self.staged = None, GENESIS, None

    def committed(self) -> None:
        staged, self.staged = self.staged, None
        if staged is None:
            return
        self.seq, self.hash, ranges = staged
        high = self.high
        if len(high) + len(ranges) > self.MAX_PRODUCERS:
            high.clear()
        for key, (_lo, hi) in ranges.items():
            if high.get(key, hi) <= hi:
                high[key] = hi

    def beyond(self, ranges: dict[tuple, list[int]]) -> bool:
        """Every producer's lowest producer_seq in the batch is above what this writer has seen stored."""
        high = self.high
        for key, (lo, _hi) in ranges.items():
            seen = high.get(key)
            if seen is not None and lo <= seen:
                return False
        return True


def write(cur, dialect, prepared: list[Prepared], tail: Tail | None = None, commit: bool = False) -> list[int]:
    """Number, chain and insert ``prepared`` inside the caller's write transaction; returns seqs.
    ``commit``: the caller commits right after; the insert may end the transaction with it where
    the backend does both in one round trip (``Dialect.insert_events``).

    ``tail``: the writer's memory (see the module's NOTE). When it knows the tail and every triple
    is new to it, nothing is read: the batch is numbered from the remembered tail and inserted,
    and the database's keys are the check (``StaleTail`` if they refuse). Otherwise the tail is
    read and the triples looked up. Either way ``tail.staged`` holds the new end, for
    ``tail.committed()`` after the commit.
    """
    ranges, increasing = _ranges(prepared)
    if tail is not None and tail.seq is not None and increasing and tail.beyond(ranges):
        last_seq = tail.seq
        rows = chain(prepared, last_seq, tail.hash)
        try:
            dialect.insert_events(cur, rows, commit)
        except dialect.integrity_error as e:
            raise StaleTail(str(e)) from e
        tail.staged = (last_seq + len(rows), rows[-1][10], ranges)
        return list(range(last_seq + 1, last_seq + 1 + len(rows)))
    last_seq, prev = read_tail(cur)
    stored = _stored(cur, dialect, ranges) if last_seq else {}
    if increasing and not stored:     # the usual case: all new, no repeats
        rows = chain(prepared, last_seq, prev)
        dialect.insert_events(cur, rows, commit)
        if tail is not None:
            tail.staged = (last_seq + len(rows), rows[-1][10], ranges)
        return list(range(last_seq + 1, last_seq + 1 + len(prepared)))
    seqs: list[int] = []
    new: list[Prepared] = []
    in_batch: dict[tuple, tuple] = {}
    seq = last_seq
    for p in prepared:
        key = (p[1], p[2], p[3])
        hit = stored.get(key) or in_batch.get(key)
        if hit is not None:
            if not _same(hit, p):
                raise _conflict(p, hit)
            seqs.append(hit[0])
            continue
        seq += 1
        new.append(p)
        in_batch[key] = (seq, p[4], p[5], p[8])
        seqs.append(seq)
    if new:
        rows = chain(new, last_seq, prev)
        dialect.insert_events(cur, rows, commit)
        last_seq, prev = last_seq + len(rows), rows[-1][10]
    if tail is not None:
        tail.staged = (last_seq, prev, ranges)
    return seqs
