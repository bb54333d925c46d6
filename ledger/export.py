"""Export a ledger to JSON lines and import it back, byte for byte, chain and all.

One object per line, in seq order:

    {"seq": 1, "ts_ns": ..., "producer": "control", "epoch": 3, "producer_seq": 1,
     "correlation_id": null, "causation": null, "type": "MoveRequested", "schema_version": 1,
     "event": {"type": "MoveRequested", "move_id": ..., ...},    # events.event_to_json_obj
     "row_hash": "<64 hex>"}

``event`` is the decoded (current-schema) event, readable and greppable. When re-encoding it does
not reproduce the stored payload bytes (a row stored under an older schema, upcast on read), the
line also carries ``"payload": "<base64 of the stored bytes>"`` so the import can rebuild the exact
row and its hash still verifies.

Import is all or nothing: into an empty ledger only (LedgerConflict otherwise), in ONE transaction
holding the write lock, recomputing the chain line by line and comparing it with each line's
``row_hash``; the first broken line raises LedgerCorrupt naming the line and seq, and the
transaction is rolled back, so nothing is written.
"""
from __future__ import annotations

import base64
import binascii
from typing import IO, TYPE_CHECKING, Callable

import msgspec

from residency.events import DecodeError, decode_event, encode_event, event_from_json_obj, event_to_json_obj
from residency.events.catalog import EVENT_TYPES
from residency.ledger import append as _append
from residency.ledger.chain import GENESIS, row_hash
from residency.ledger.columns import columns_of
from residency.ledger.errors import LedgerConflict, LedgerCorrupt

if TYPE_CHECKING:
    from residency.ledger.store import LedgerStore

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_ENVELOPE = ("seq", "ts_ns", "producer", "epoch", "producer_seq", "correlation_id", "causation",
             "type", "schema_version")
_TYPES = {"seq": int, "ts_ns": int, "producer": str, "epoch": int, "producer_seq": int,
          "correlation_id": (str, type(None)), "causation": (str, type(None)), "type": str, "schema_version": int}
IMPORT_BATCH = 5_000


def export_jsonl(store: "LedgerStore", fp: IO[str]) -> int:
    n = 0
    write = fp.write
    for rows in store.raw_batches():
        lines = []
        for r in rows:
            payload = bytes(r[9])
            try:
                event = decode_event(payload, r[5], r[6])
            except DecodeError as e:
                raise LedgerCorrupt(f"cannot export seq {r[0]}: {e}") from e
            obj = dict(zip(_ENVELOPE, (r[0], r[1], r[2], r[3], r[4], r[7], r[8], r[5], r[6])))
            obj["event"] = event_to_json_obj(event)
            obj["row_hash"] = bytes(r[10]).hex()
            if encode_event(event) != payload:
                obj["payload"] = base64.b64encode(payload).decode("ascii")
            lines.append(_json_encode(obj).decode())
        write("\n".join(lines) + "\n")
        n += len(rows)
    return n


def _row_from_line(lineno: int, line: str, expected_seq: int, prev: bytes) -> tuple:
    """The full events row for one export line; raises LedgerCorrupt naming the line."""
    def corrupt(why: str) -> LedgerCorrupt:
        return LedgerCorrupt(f"line {lineno} (seq {expected_seq}) of the import is broken: {why}")

    try:
        obj = _json_decode(line)
    except msgspec.DecodeError as e:
        raise corrupt(f"not JSON ({e})") from e
    if not isinstance(obj, dict):
        raise corrupt("not a JSON object")
    for key, typ in _TYPES.items():
        if key not in obj:
            raise corrupt(f"no {key!r}")
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
            raise corrupt(f"{key!r} has the wrong type")
    if obj["seq"] != expected_seq:
        raise corrupt(f"its seq is {obj['seq']}, expected {expected_seq}")
    type_, version = obj["type"], obj["schema_version"]
    try:
        event = event_from_json_obj(obj.get("event"))
        if type(event).__name__ != type_:
            raise DecodeError(f"line says {type_} but its event is {type(event).__name__}")
        if "payload" in obj:
            payload = base64.b64decode(obj["payload"], validate=True)
            if decode_event(payload, type_, version) != event:
                raise DecodeError("its payload and its event disagree")
        else:
            cls = EVENT_TYPES[type_]
            if version != cls.SCHEMA_VERSION:
                raise DecodeError(f"schema_version {version} needs the stored payload, which the line lacks")
            payload = encode_event(event)
        stored = bytes.fromhex(obj["row_hash"]) if isinstance(obj.get("row_hash"), str) else b""
    except (DecodeError, binascii.Error, ValueError, TypeError) as e:
        raise corrupt(str(e)) from e
    canon = (expected_seq, obj["ts_ns"], obj["producer"], obj["epoch"], obj["producer_seq"], type_, version,
             obj["correlation_id"], obj["causation"], payload)
    digest = row_hash(prev, canon)
    if digest != stored:
        raise corrupt("its row_hash does not match its contents chained from the line before")
    return (*canon, digest, *columns_of(event))


def import_jsonl(store: "LedgerStore", fp: IO[str], progress: Callable[[int], None] | None = None) -> int:
    raw, d = store._raw, store._raw.dialect
    with raw.write_lock, raw.writing("importing events", "full") as (conn, cur):
        raw.tail.forget()            # rows are written here without it
        if _append.read_tail(cur)[0] != 0:
            raise LedgerConflict(f"cannot import into {store.url}: it already holds events (import needs an empty ledger)")
        seq, prev, batch = 0, GENESIS, []
        for lineno, line in enumerate(fp, 1):
            if not line.strip():
                continue
            row = _row_from_line(lineno, line, seq + 1, prev)
            seq, prev = seq + 1, row[10]
            batch.append(row)
            if len(batch) >= IMPORT_BATCH:
                d.insert_events(cur, batch)
                batch.clear()
                if progress is not None:
                    progress(seq)
        if batch:
            d.insert_events(cur, batch)
        conn.commit()
        if not d.sqlite:   # give the planner statistics now rather than whenever autovacuum gets to it
            cur.execute("ANALYZE events")
            conn.commit()
    return seq
