"""Residency's vocabulary: every event, command and ack as a msgspec Struct.

Imports nothing of ours. Everything that crosses a process or lands in the ledger is one of
these structs; see ``events.catalog`` for the union and ``events.codec`` for the bytes.
"""
from residency.events.envelope import Envelope, Recorded
from residency.events.catalog import *  # noqa: F401,F403  (the catalog is the package's API)
from residency.events.catalog import EVENT_TYPES, Event, event_type_name
from residency.events.commands import *  # noqa: F401,F403
from residency.events.asks import *  # noqa: F401,F403
from residency.events.codec import (
    DecodeError,
    decode_event,
    decode_message,
    encode_event,
    encode_message,
    event_from_json_obj,
    event_to_json_obj,
)

__all__ = [
    "Envelope",
    "Recorded",
    "Event",
    "EVENT_TYPES",
    "event_type_name",
    "DecodeError",
    "encode_event",
    "decode_event",
    "encode_message",
    "decode_message",
    "event_to_json_obj",
    "event_from_json_obj",
]
from residency.events import asks as _asks, catalog as _catalog, commands as _commands  # noqa: E402

__all__ += _catalog.__all__ + _commands.__all__ + _asks.__all__
