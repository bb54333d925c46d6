"""Anchors: the chain's head, kept outside the database, so a cut or rewritten tail is caught.

The hash chain proves every row against the rows before it, but not against a copy of the rows
that was never stored: someone able to write the database can drop the last rows, or rewrite a
row and recompute every hash after it, and the chain still verifies. What catches that is a
head (seq, row_hash) remembered somewhere the database's writer cannot reach:

    residency serve --anchor FILE [--anchor-key KEYFILE]     appends the head every N appends and on stop
    residency ledger anchor --anchor FILE [--anchor-key ...] appends the head now (for cron)
    residency ledger verify --anchor FILE [--anchor-key ...] checks every line of it
    residency ledger verify --expect-head SEQ:HASH           checks one head an operator kept

The file holds one JSON object per line, newest last:

    {"seq": 1234, "row_hash": "<64 hex>", "ts_ns": ..., "mac": "<64 hex>"}

``mac`` is HMAC-SHA256 under the key file's bytes over ``"<seq>:<row_hash hex>:<ts_ns>"``; it is
there when the writer had a key. With a key, verify refuses a line without a mac or with a wrong
one, so a copy of the file shipped elsewhere cannot be edited to agree with a forged ledger by
anyone without the key. A line checks out when the verified ledger reaches its seq and the
stored row_hash there is the line's: a hash commits to every row up to it, so one good anchor
vouches for its whole prefix. A ledger that ends before an anchor's seq was cut; one whose hash
at that seq differs was rewritten at or before it (the previous good line bounds where).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

from residency.ledger.chain import HASH_BYTES
from residency.ledger.errors import LedgerCorrupt, LedgerError

MIN_KEY_BYTES = 16


class Anchor(NamedTuple):
    seq: int
    row_hash: bytes
    ts_ns: int | None = None
    where: str = "--expect-head"      # how a problem names it: "--expect-head" or "FILE line N"


def load_key(path: str | os.PathLike) -> bytes:
    """The key file's bytes (LedgerError if unreadable or shorter than MIN_KEY_BYTES)."""
    try:
        key = Path(path).read_bytes()
    except OSError as e:
        raise LedgerError(f"cannot read the anchor key {path}: {e.strerror}") from e
    if len(key) < MIN_KEY_BYTES:
        raise LedgerError(f"the anchor key {path} holds {len(key)} bytes; a key needs {MIN_KEY_BYTES} or more "
                          f"(e.g. `head -c 32 /dev/urandom > {path}`)")
    return key


def _mac(key: bytes, seq: int, row_hash: bytes, ts_ns: int) -> str:
    return hmac.new(key, f"{seq}:{row_hash.hex()}:{ts_ns}".encode(), hashlib.sha256).hexdigest()


def parse_head(text: str) -> Anchor:
    """``SEQ:HASH`` (HASH: the full 64 hex digits `ledger verify` prints) as an Anchor."""
    seq, _, hexed = text.partition(":")
    try:
        digest = bytes.fromhex(hexed)
        n = int(seq)
    except ValueError:
        digest, n = b"", -1
    if n < 1 or len(digest) != HASH_BYTES:
        raise LedgerError(f"--expect-head {text!r} is not SEQ:HASH with seq >= 1 and the full "
                          f"{2 * HASH_BYTES}-digit hash `ledger verify` prints")
    return Anchor(n, digest)


def append(path: str | os.PathLike, seq: int, row_hash: bytes, key: bytes | None) -> Anchor:
    """Append the head (seq, row_hash) to the anchor file, flushed to disk; returns it."""
    ts_ns = time.time_ns()
    line = {"seq": seq, "row_hash": row_hash.hex(), "ts_ns": ts_ns}
    if key is not None:
        line["mac"] = _mac(key, seq, row_hash, ts_ns)
    try:
        with open(path, "a", encoding="utf-8") as fp:
            fp.write(json.dumps(line) + "\n")
            fp.flush()
            os.fsync(fp.fileno())
    except OSError as e:
        raise LedgerError(f"cannot write the anchor file {path}: {e.strerror}") from e
    return Anchor(seq, row_hash, ts_ns)


def read(path: str | os.PathLike, key: bytes | None) -> list[Anchor]:
    """Every anchor in the file, in file order. LedgerCorrupt names the first line that is not an
    anchor, or (with ``key``) whose mac is missing or wrong; a file with macs needs the key."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LedgerError(f"cannot read the anchor file {path}: {e.strerror}") from e
    out = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(text)
            seq, digest, ts_ns = obj["seq"], bytes.fromhex(obj["row_hash"]), obj["ts_ns"]
            mac = obj.get("mac")
            if type(seq) is not int or type(ts_ns) is not int or len(digest) != HASH_BYTES or seq < 1:
                raise ValueError("a field has the wrong type or size")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LedgerCorrupt(f"{where} is not an anchor: {e}") from e
        if key is None and mac is not None:
            raise LedgerError(f"{where} carries a mac: pass the key it was written with (--anchor-key)")
        if key is not None:
            if mac is None:
                raise LedgerCorrupt(f"{where} has no mac, and the anchors are checked with a key")
            if not hmac.compare_digest(str(mac), _mac(key, seq, digest, ts_ns)):
                raise LedgerCorrupt(f"{where}: its mac is wrong (edited, or written under another key)")
        out.append(Anchor(seq, digest, ts_ns, where))
    if not out:
        raise LedgerCorrupt(f"{path} holds no anchor")
    return out


def check(anchors: list[Anchor], verified_seqs: int, hash_at) -> tuple[int, str] | None:
    """None when every anchor agrees with the ledger; else (the seq, one sentence naming it).

    ``verified_seqs``: how many rows verified (the chain is sound through that seq);
    ``hash_at(seq)``: the stored row_hash at a seq. Only call after a verify that passed.
    """
    for a in sorted(anchors, key=lambda a: a.seq):
        if a.seq > verified_seqs:
            return a.seq, (f"seq {a.seq}: the ledger ends at seq {verified_seqs} but {a.where} says seq {a.seq} was "
                    f"written (hash {a.row_hash.hex()}): rows were cut from its end")
        stored = hash_at(a.seq)
        if stored != a.row_hash:
            return a.seq, (f"seq {a.seq}: its row_hash is {stored.hex()} but {a.where} says {a.row_hash.hex()}: "
                    f"the chain was rewritten at or before seq {a.seq} and its hashes recomputed")
    return None
