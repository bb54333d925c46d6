"""Verify a ledger: seq continuity, the hash chain, and that every payload decodes.

Checks, row by row, stopping at the first problem (``VerifyReport.first_bad_seq``):
    1. seqs start at 1 and have no gaps;
    2. each stored ``row_hash`` equals SHA-256(previous hash || canonical bytes) (``ledger.chain``);
    3. the payload decodes with ``events.decode_event`` under the row's type and schema version
       (unknown types, newer schemas, and a payload whose tag differs from the row's type all fail);
    4. when the rows carry the audit columns (``EVENT_COLUMNS``, as ``LedgerStore.verify`` reads
       them), they are exactly what ``ledger.columns`` extracts from the decoded event (a row of an
       older schema: each is NULL or that, see ``_older_agrees``). They are
       outside the hash, so this is what makes an edited column (say, a 4 MiB move's bytes set to
       390 GiB) a named bad seq rather than a wrong audit total.
``StateCheckpoint`` events are collected into ``report.checkpoints`` as (seq, through_seq,
state_hash): the ledger cannot check them (that needs control's fold), the caller does.

Speed: rows arrive as raw DBAPI tuples in large batches; per row the work is one msgpack encode,
one SHA-256 and one msgspec decode, with no per-row objects of our own.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable

import msgspec

from residency.events import DecodeError, decode_event
from residency.events.catalog import EVENT_TYPES, AnyEvent
from residency.ledger.chain import GENESIS, HASH_BYTES, row_hash
from residency.ledger.columns import NAMES, extractor

_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256
_CURRENT = {name: cls.SCHEMA_VERSION for name, cls in EVENT_TYPES.items()}
_decode = msgspec.msgpack.Decoder(AnyEvent).decode
_COLUMNS_OF = {name: extractor(cls) for name, cls in EVENT_TYPES.items()}
AUDITED = 17          # a row this long carries the audit columns after the row hash

Progress = Callable[[int, int], None]   # (events verified so far, events in the ledger)


class VerifyReport(msgspec.Struct, kw_only=True):
    ok: bool
    num_events: int                       # rows that verified (all of them when ok)
    first_bad_seq: int | None = None
    problem: str | None = None            # one sentence naming the seq and what is wrong
    last_hash: bytes = GENESIS            # row_hash of the last row that verified
    checkpoints: list[tuple[int, int, str]] = []

    @property
    def last_hash_hex(self) -> str:
        return self.last_hash.hex()


def diagnose_hash(seq: int, stored: bytes, computed: bytes, nxt: tuple | None) -> str:
    """One sentence for a row whose stored hash is not what its contents imply."""
    if len(stored) != HASH_BYTES:
        return f"seq {seq}: row_hash is {len(stored)} bytes, not {HASH_BYTES}"
    if nxt is None:
        return f"seq {seq}: the row does not match its stored row_hash (it is the last row: its contents or its hash changed)"
    if bytes(nxt[10]) == row_hash(computed, nxt):
        return f"seq {seq}: its stored row_hash was altered (seq {seq + 1} chains from the hash its contents imply)"
    if bytes(nxt[10]) == row_hash(stored, nxt):
        return (f"seq {seq}: the row no longer matches its stored row_hash: it was edited after it was written "
                f"(or the row before it was rewritten together with its hash)")
    return f"seq {seq}: the row does not match its stored row_hash and seq {seq + 1} does not chain from it either"


def _older_agrees(stored: tuple, derived: tuple) -> bool:
    """A row stored under an older schema: the columns were extracted from the event as it was
    then, and an upcast may fill a field that did not exist (BlocksFreed v1 had no tier). Each
    stored column must be NULL or what the upcast event says: nothing may disagree."""
    return all(s is None or s == d for s, d in zip(stored, derived))


def columns_problem(seq: int, stored: tuple, derived: tuple) -> str:
    """One sentence for a row whose audit columns are not what its payload says."""
    diffs = ", ".join(f"{name} is {s!r}, its payload says {d!r}"
                      for name, s, d in zip(NAMES, stored, derived) if s != d)
    return f"seq {seq}: its audit columns were edited ({diffs}); they are outside the hash chain, its payload is not"


def verify_batches(batches: Iterable[list[tuple]], end: int, peek: Callable[[int], tuple | None],
                   progress: Progress | None = None, *, start: int = 1, prev: bytes = GENESIS,
                   next_seq: Callable[[int], int | None] | None = None) -> VerifyReport:
    """Verify raw rows ``start..end`` (RawRow-shaped tuples, in seq order, batched).

    ``prev`` is the stored row_hash of row ``start - 1`` (GENESIS for row 1): a range needs only
    its predecessor's stored hash (see ledger.verify_parallel). ``peek(seq)`` fetches one row and
    ``next_seq(seq)`` the first stored seq >= seq, both only to word a problem. ``num_events`` counts
    the rows of this range that verified; ``progress(done, of)`` likewise.
    """
    expected = start
    checkpoints: list[tuple[int, int, str]] = []
    sha, enc, current, decode = _sha256, _encode, _CURRENT, _decode
    of = end - start + 1

    def bad(seq: int, problem: str) -> VerifyReport:
        return VerifyReport(ok=False, num_events=expected - start, first_bad_seq=seq, problem=problem,
                            last_hash=prev, checkpoints=checkpoints)

    for batch in batches:
        for row in batch:
            seq = row[0]
            if seq != expected:
                where = "the first stored row" if expected == 1 else "the next stored row"
                return bad(expected, f"seq {expected} is missing ({where} is seq {seq})")
            h = sha(prev)
            h.update(enc(row[:10]))
            digest = h.digest()
            stored = row[10]
            if digest != stored:
                return bad(seq, diagnose_hash(seq, bytes(stored), digest, peek(seq + 1)))
            type_ = row[5]
            # Fast path (current schema): the bare decoder plus the tag check decode_event does;
            # anything else, or any failure, goes through decode_event for its exact verdict.
            try:
                event = decode(row[9]) if current.get(type_) == row[6] else None
            except Exception:
                event = None
            if event is None or event.__class__.__name__ != type_:
                try:
                    event = decode_event(row[9], type_, row[6])
                except DecodeError as e:
                    return bad(seq, f"seq {seq}: {e}")
            if len(row) == AUDITED:
                derived = _COLUMNS_OF[type_](event)
                stored = row[11:]
                if stored != derived and (current.get(type_) == row[6] or not _older_agrees(stored, derived)):
                    return bad(seq, columns_problem(seq, stored, derived))
            if type_ == "StateCheckpoint":
                checkpoints.append((seq, event.through_seq, event.state_hash))
            prev = digest
            expected += 1
        if progress is not None:
            progress(expected - start, of)
    if expected <= end:  # the range's tail is missing (or rows vanished while we read)
        nxt = next_seq(expected) if next_seq is not None else None
        where = "the first stored row" if expected == 1 else "the next stored row"
        return bad(expected, f"seq {expected} is missing ({where} is seq {nxt})" if nxt is not None
                   else f"seq {expected} is missing (the ledger ends at seq {expected - 1})")
    return VerifyReport(ok=True, num_events=expected - start, last_hash=prev, checkpoints=checkpoints)
