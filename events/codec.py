"""Bytes for events and messages: msgpack for storage and sockets, JSON objects for export.

One encoder and one decoder per union, built once. Decoding never trusts its input: anything
malformed raises ``DecodeError`` with the reason, which callers turn into a named error.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Sequence

import msgspec

from residency.events.catalog import EVENT_TYPES, AnyEvent, Event
from residency.events.commands import AnyMessage, Message
from residency.events.upcast import upcast


class DecodeError(ValueError):
    """A payload that is not a valid event or message; the message says why."""


_encoder = msgspec.msgpack.Encoder()
_event_decoder = msgspec.msgpack.Decoder(AnyEvent)
_message_decoder = msgspec.msgpack.Decoder(AnyMessage)
_raw_decoder = msgspec.msgpack.Decoder()
# (type name, its current schema version) -> a decoder of exactly that type (it checks the payload's tag)
_DECODE_CURRENT = {(name, cls.SCHEMA_VERSION): msgspec.msgpack.Decoder(cls).decode for name, cls in EVENT_TYPES.items()}
# What a decode function of ``current_decoders`` raises on a bad payload.
PAYLOAD_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
_type_and_version = itemgetter(0, 1)
# A packed run (``decode_packed``): every payload at once, and only their spans, as msgpack arrays.
_packed_decoder = msgspec.msgpack.Decoder(list[AnyEvent])
_spans_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_type_name = {cls: name for name, cls in EVENT_TYPES.items()}.__getitem__


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(payload: bytes, type_name: str | None = None, schema_version: int | None = None) -> Event:
    """Decode a stored payload; ``type_name``/``schema_version`` come from the row's columns.

    A payload stored under an older schema is upcast first. The row's type must match the
    payload's own tag, so a payload swapped between rows is caught.
    """
    cls = EVENT_TYPES.get(type_name) if type_name is not None else None
    if type_name is not None and cls is None:
        raise DecodeError(f"unknown event type {type_name!r}")
    try:
        if cls is not None and schema_version is not None and schema_version != cls.SCHEMA_VERSION:
            if schema_version > cls.SCHEMA_VERSION:
                raise DecodeError(
                    f"{type_name} schema v{schema_version} is newer than this code (v{cls.SCHEMA_VERSION})"
                )
            raw = _raw_decoder.decode(payload)
            if not isinstance(raw, list) or not raw:
                raise DecodeError(f"{type_name} payload is not an array")
            if raw[0] != type_name:          # an upcaster of one type must never see another's payload
                raise DecodeError(f"row says {type_name} but payload is {str(raw[0])[:64]}")
            raw = upcast(type_name, schema_version, cls.SCHEMA_VERSION, raw)
            event = msgspec.convert(raw, type=AnyEvent)
        else:
            event = _event_decoder.decode(payload)
    except DecodeError:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError) as e:
        raise DecodeError(f"payload does not decode as {type_name or 'an event'}: {e}") from e
    if type_name is not None and type(event).__name__ != type_name:
        raise DecodeError(f"row says {type_name} but payload is {type(event).__name__}")
    return event


def current_decoders(rows: Sequence[tuple]) -> list | None:
    """One decode function per row of ``rows`` ((type name, schema version, ...) tuples), for a
    run stored under each type's current schema.

    ``decoders[i](payload)`` decodes row i's payload as exactly the row's type (the payload's tag
    must name it, as ``decode_event`` checks) and raises one of ``PAYLOAD_ERRORS`` otherwise.
    None when any row has an unknown type or another schema version: decode those rows with
    ``decode_event``, which upcasts and words the error. (Replay's fast path: a few C-level passes
    over the run, no Python work per row.)
    """
    try:
        return list(map(_DECODE_CURRENT.__getitem__, map(_type_and_version, rows)))
    except (KeyError, TypeError):
        return None


def decode_packed(num_rows: int, payloads: bytes, types: str, lengths: str) -> list[Event] | None:
    """Decode ``num_rows`` payloads stored back to back, all in one msgspec call, or None.

    For rows stored under their type's current schema (the caller knows; ``LedgerStore.packed_runs``
    packs only those): ``types`` names each row's type ("MoveAcked,MoveRequested,...") and
    ``lengths`` gives each payload's size in bytes ("41, 67, ..."), in row order. The events come
    back only when they are exactly what ``current_decoders`` gives row by row: each payload is
    exactly one msgpack value (its span in the concatenation is its own length: bytes cannot
    slide from one row into the next), each decodes, and each is of its row's type. Anything
    else (an unknown type, a bad payload) is None: decode those rows one by one, which names
    the seq of a bad payload.

        payloads:  |99 a9 MoveAcked ...|9c ad MoveRequested ...|...     (num_rows values)
        framed:    dd <num_rows, 4 bytes> payloads                     (one msgpack array)
    """
    framed = b"\xdd" + num_rows.to_bytes(4, "big") + payloads
    try:
        # a list's repr is "[41, 67, ...]": the spans' lengths, written as ``lengths`` writes them
        if str(list(map(len, _spans_decoder.decode(framed))))[1:-1] != lengths:
            return None
        events = _packed_decoder.decode(framed)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
        return None
    if ",".join(map(_type_name, map(type, events))) != types:
        return None
    return events


def encode_message(msg: Message | Event) -> bytes:
    return _encoder.encode(msg)


def decode_message(data: bytes) -> Message | Event:
    try:
        return _message_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DecodeError(f"malformed message: {e}") from e


def event_to_json_obj(event: Event) -> dict[str, Any]:
    """The event as a JSON-ready dict (bytes as base64 strings, as msgspec writes them)."""
    obj: dict[str, Any] = {"type": type(event).__name__}
    for k, v in msgspec.structs.asdict(event).items():
        # bytes as base64, and records inside an event (ExpertsMoved.moves) as the arrays msgspec
        # writes, so the stdlib's json.dumps takes the dict too
        nested = type(v) is list and v and isinstance(v[0], msgspec.Struct)
        obj[k] = msgspec.to_builtins(v) if type(v) is bytes or nested else v
    return obj


def event_to_display_obj(event: Event) -> dict[str, Any]:
    """``event_to_json_obj`` for people (``residency timeline --json``, ``ctl --json``): an ack's
    packed checksums as one 16-digit hex string per block, in the command's block order. Not for
    export: ``event_from_json_obj`` reads only ``event_to_json_obj``'s form."""
    obj = event_to_json_obj(event)
    unpack = getattr(event, "checksum_list", None)
    if unpack is not None:
        obj["checksums"] = [f"{c:016x}" for c in unpack()]
    return obj


def event_from_json_obj(obj: dict[str, Any]) -> Event:
    if not isinstance(obj, dict) or "type" not in obj:
        raise DecodeError("event object has no 'type'")
    cls = EVENT_TYPES.get(obj["type"])
    if cls is None:
        raise DecodeError(f"unknown event type {obj['type']!r}")
    unknown = set(obj) - {"type"} - set(cls.__struct_fields__)
    if unknown:
        raise DecodeError(f"{obj['type']}: unknown fields {sorted(unknown)}")
    # array_like structs convert from arrays only: lay the object out in field order, stopping
    # at the first absent field so trailing defaults apply (a missing required one fails).
    raw: list[Any] = [obj["type"]]
    for name in cls.__struct_fields__:
        if name not in obj:
            break
        raw.append(obj[name])
    try:
        return msgspec.convert(raw, type=AnyEvent)
    except msgspec.ValidationError as e:
        raise DecodeError(f"{obj['type']}: {e}") from e
