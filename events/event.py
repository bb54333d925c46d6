"""The base of every event the ledger records, and the tiers they name.

An event is a tagged msgspec Struct (the tag is the class name) encoded ``array_like``: a stored
payload is a positional msgpack array. The classes live by role (``events.memory_events``,
``events.serving_events``, ``events.rebind_events``); ``events.catalog`` holds their union.
NOTE: because payloads are positional, a new field is only ever appended at the end of its class
with a default; any other change bumps the class's ``SCHEMA_VERSION`` and adds an upcaster in
``events.upcast`` (ledgers already written must still decode).
"""
from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = ("device", "host", "disk")


class Event(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True, gc=False):
    SCHEMA_VERSION: ClassVar[int] = 1


__all__ = ["Event", "Tier", "TIERS"]
