"""The hash chain: every row's hash commits to its own contents and to every row before it.

    row_hash(n) = SHA-256( row_hash(n-1) || canonical(n) )        row_hash(0) = 32 zero bytes
    canonical(n) = msgpack [seq, ts_ns, producer, epoch, producer_seq, type,
                            schema_version, correlation_id, causation, payload]

``payload`` is the stored msgpack bytes (``events.encode_event``), hashed as a msgpack ``bin``.
The denormalized audit columns (``ledger.columns``) are NOT hashed: they are derived from the
payload, and ``verify`` checks each row's against it.

NOTE: what a chain proves. Editing, dropping or reordering any row breaks the hash of that row
or of the next one, so ``verify`` names the first bad seq. Cutting rows off the end, or rewriting
a row *and* every hash after it, cannot be detected from inside the database: that takes a head
kept outside it (``ledger.anchor``).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec

GENESIS = bytes(32)
HASH_BYTES = 32

_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256

# Indexes into a canonical row tuple (and the first ten fields of ledger.store.RawRow).
SEQ, TS_NS, PRODUCER, EPOCH, PRODUCER_SEQ, TYPE, SCHEMA_VERSION, CORRELATION_ID, CAUSATION, PAYLOAD = range(10)


def canonical(row: Sequence) -> bytes:
    """Canonical bytes of the first ten fields of ``row`` (see the module docstring)."""
    return _encode(tuple(row[:10]))


def row_hash(prev_hash: bytes, row: Sequence) -> bytes:
    """The chain hash of ``row`` given the previous row's hash."""
    h = _sha256(prev_hash)
    h.update(_encode(tuple(row[:10])))
    return h.digest()


def chain_hashes(prev_hash: bytes, rows: Sequence[Sequence]) -> list[bytes]:
    """Hashes of consecutive ``rows`` (each exactly the ten canonical fields), chained from ``prev_hash``."""
    out: list[bytes] = []
    append = out.append
    sha, enc = _sha256, _encode
    for row in rows:
        h = sha(prev_hash)
        h.update(enc(row))
        prev_hash = h.digest()
        append(prev_hash)
    return out
