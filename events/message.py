"""The base of every message between the control process and its workers: a tagged msgspec
Struct encoded as a positional msgpack array (``events.codec``)."""
from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True, gc=False):
    pass
