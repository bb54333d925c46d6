"""The packed form of a move's block checksums (``MoveAcked.checksums``): each block's psum64 as a
little-endian uint64, 8 bytes per block, so an ack of a thousand blocks decodes as one bytes object
instead of a thousand Python ints."""
from __future__ import annotations

import array
import sys


def pack_checksums(values) -> bytes:
    """Checksums in [0, 2^64) as MoveAcked carries them (ValueError names one out of range)."""
    try:
        a = array.array("Q", values)
    except OverflowError as e:
        raise ValueError(f"checksums must be in [0, 2^64): {e}") from None
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_checksums(data: bytes) -> list[int]:
    if len(data) % 8:
        raise ValueError(f"packed checksums are 8 bytes each, got {len(data)} bytes")
    a = array.array("Q")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()
