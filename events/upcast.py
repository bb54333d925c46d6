"""Upcasters: turn a payload stored under an older schema into the current shape.

A payload is a msgpack array ``[type, field1, field2, ...]`` (see ``events.catalog``). An
upcaster takes that list at version N and returns it at version N+1; they chain until the
current ``SCHEMA_VERSION``.

An upcaster rewrites one row. A change that turns two rows into one has none: a release's answer
was an ack that moved nothing plus ``BlocksFreed(reason="release")`` and is now one
``CopiesReleased``, and merging the old rows would renumber the seqs that checkpoints, causation
and the hash chain name. The old rows stay what they were, true facts, and the fold and every
reader give them the meaning of the new one (``tests/control/test_release_forms.py``).
"""
from __future__ import annotations

from typing import Callable

Upcaster = Callable[[list], list]


def _blocks_freed_v1_to_v2(raw: list) -> list:
    # v1: [type, worker, blocks, bytes, reason]           (only device copies were ever freed)
    # v2: [type, worker, tier, blocks, bytes, reason]
    return [raw[0], raw[1], "device", *raw[2:]]


def _move_acked_v1_to_v2(raw: list) -> list:
    # v1: [type, move_id, worker, bytes_moved, bytes_freed_src, checksum_ok, started_ns, finished_ns,
    #      checksums (list of ints; absent when empty)]
    # v2: the same with the checksums packed (events.catalog.pack_checksums)
    from residency.events.catalog import pack_checksums
    if len(raw) < 9:
        return [*raw, b""]
    return [*raw[:8], pack_checksums(raw[8]), *raw[9:]]


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("BlocksFreed", 1): _blocks_freed_v1_to_v2,
    ("MoveAcked", 1): _move_acked_v1_to_v2,
}


def upcast(type_name: str, version: int, current: int, raw: list) -> list:
    """Apply upcasters from ``version`` to ``current``; KeyError names a missing step."""
    while version < current:
        step = UPCASTERS.get((type_name, version))
        if step is None:
            raise KeyError(f"no upcaster for {type_name} v{version} -> v{version + 1}")
        raw = step(raw)
        version += 1
    return raw
