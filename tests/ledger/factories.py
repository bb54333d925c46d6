"""Fresh random events and envelopes for ledger tests (never constant data).

``random_event`` walks the struct's type info, so every event in the catalog (including ones
added later) can be generated without a hand-written factory.
"""
from __future__ import annotations

import random
import string
import time
from typing import Any

import msgspec.inspect as mi

from residency.events import Envelope
from residency.events.catalog import EVENT_TYPES, Event

ALL_TYPES = sorted(EVENT_TYPES)


def _text(rng: random.Random, lo: int = 1, hi: int = 24) -> str:
    alphabet = string.ascii_letters + string.digits + "-_:/ éλ"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _value(rng: random.Random, t: mi.Type) -> Any:
    if isinstance(t, mi.IntType):
        return rng.choice([rng.randrange(0, 1 << 8), rng.randrange(0, 1 << 40), rng.randrange(0, 1 << 63)])
    if isinstance(t, mi.StrType):
        return _text(rng)
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.BytesType):
        return rng.randbytes(8 * rng.randint(0, 6))
    if isinstance(t, mi.LiteralType):
        return rng.choice(t.values)
    if isinstance(t, mi.ListType):
        return [_value(rng, t.item_type) for _ in range(rng.randint(0, 6))]
    if isinstance(t, mi.DictType):
        return {_value(rng, t.key_type): _value(rng, t.value_type) for _ in range(rng.randint(0, 3))}
    if isinstance(t, mi.StructType):          # a record inside an event (ExpertsMoved.moves)
        return t.cls(**{f.name: _value(rng, f.type) for f in t.fields})
    if isinstance(t, mi.UnionType):
        choices = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if any(isinstance(u, mi.NoneType) for u in t.types) and rng.random() < 0.3:
            return None
        return _value(rng, rng.choice(choices))
    raise NotImplementedError(f"no random value for {t}")


def random_event(rng: random.Random, type_name: str | None = None, exclude: tuple[str, ...] = (), **fixed: Any) -> Event:
    cls = EVENT_TYPES[type_name or rng.choice([t for t in ALL_TYPES if t not in exclude])]
    kwargs = {f.name: _value(rng, f.type) for f in mi.type_info(cls).fields}
    kwargs.update(fixed)
    return cls(**kwargs)


def envelope(rng: random.Random, producer: str, epoch: int, producer_seq: int, ts_ns: int | None = None) -> Envelope:
    return Envelope(
        producer=producer, epoch=epoch, producer_seq=producer_seq,
        ts_ns=ts_ns if ts_ns is not None else time.time_ns() + rng.randrange(-10**9, 10**9),
        correlation_id=rng.choice([None, _text(rng)]),
        causation=rng.choice([None, str(rng.randrange(1, 10**6)), _text(rng)]),
    )


def random_items(rng: random.Random, n: int, producer: str | None = None, epoch: int | None = None,
                 start: int = 1, type_name: str | None = None, exclude: tuple[str, ...] = ()) -> list[tuple[Envelope, Event]]:
    """``n`` events from one producer incarnation with producer_seq start, start+1, ..."""
    producer = producer or f"worker:{rng.randrange(16)}-{rng.randrange(1 << 30):x}"
    epoch = epoch if epoch is not None else rng.randrange(1, 1 << 20)
    return [(envelope(rng, producer, epoch, start + i), random_event(rng, type_name, exclude)) for i in range(n)]
