"""The arithmetic of a rotation, pure: which bytes go where, in what order, and whether they fit.

The arena holds the outgoing image O (``out_bytes``) at offset 0; the slab holds the incoming
image I (``in_bytes``). Chunk i of both shares the arena range [i·c, (i+1)·c), so the outgoing
chunk must leave before the incoming one lands. On the host, the outgoing chunk lands where an
incoming chunk sat ``ring_depth`` (k) steps earlier — the ring is k chunks of the slab's
overshoot, so nothing is copied host to host. The slab's image alternates between two places:

  forward  (incoming at k·c, outgoing written from 0, chunks 0 → n-1)
      slab  |  ring  | I0 | I1 | I2 | ... |         O_i lands on [i·c, (i+1)·c) = where I_{i-k} was
  reverse  (incoming at 0, outgoing written from k·c, chunks n-1 → 0)
      slab  | I0 | I1 | ... | I_{n-1} |  ring  |   O_i lands where I_{i+k} was

so step t's D2H may start once the H2D of step t-k is done (host hazard), and step t's H2D once
its own D2H is done (device hazard). With k = 1 the two directions never run at once; with k ≥ 2
the D2H of step t runs while the H2D of step t-1 is still in flight.
Slab bytes needed = max(in_offset + in_bytes, out_offset + out_bytes) ≤ max(O, I) + k·c.
"""
from __future__ import annotations

from dataclasses import dataclass

from residency.dataplane.flip.errors import FlipRefused


@dataclass(frozen=True)
class Step:
    chunk: int
    out_bytes: int          # bytes of the outgoing image in this chunk (0 past its end)
    in_bytes: int           # bytes of the incoming image in this chunk


@dataclass(frozen=True)
class RotationPlan:
    out_bytes: int
    in_bytes: int
    chunk_bytes: int
    ring_depth: int
    forward: bool
    in_offset: int          # where the incoming image sits in the slab now
    out_offset: int         # where the outgoing image will sit after the flip
    slab_need_bytes: int
    steps: tuple[Step, ...]

    def arena_range(self, i: int) -> tuple[int, int]:
        return i * self.chunk_bytes, (i + 1) * self.chunk_bytes


def plan_rotation(out_bytes: int, in_bytes: int, in_offset: int, chunk_bytes: int, ring_depth: int,
                  slab_capacity: int, arena_capacity: int) -> RotationPlan | FlipRefused:
    """The plan, or the refusal with its arithmetic. Pure."""
    if chunk_bytes <= 0 or chunk_bytes % 256:
        raise ValueError(f"chunk_bytes must be a positive multiple of 256, got {chunk_bytes}")
    if ring_depth < 1:
        raise ValueError(f"ring_depth must be >= 1, got {ring_depth}")
    ring = ring_depth * chunk_bytes
    if in_bytes > arena_capacity:
        return FlipRefused("incoming image larger than the arena", in_bytes, arena_capacity)
    if in_offset == ring:
        forward, out_offset = True, 0
    elif in_offset == 0:
        forward, out_offset = False, ring
    else:
        return FlipRefused(f"incoming image at slab offset {in_offset}: a rotation with a ring of {ring_depth} "
                           f"x {chunk_bytes} bytes needs it at 0 or {ring}", in_offset, ring)
    # the slab must reach past the incoming image's end and past the outgoing one's; the farther
    # end is the need, spelled as the incoming image plus the overshoot (ring, size asymmetry)
    in_end, out_end = in_offset + in_bytes, out_offset + out_bytes
    need = max(in_end, out_end)
    if need > slab_capacity:
        if in_end >= out_end:
            terms = {"ring": in_offset, "incoming image": in_bytes}
        else:
            terms = {"ring": out_offset, "incoming image": in_bytes, "size asymmetry": out_bytes - in_bytes}
        return FlipRefused("host slab smaller than one image plus the overshoot", need, slab_capacity, terms)
    n = -(-max(out_bytes, in_bytes) // chunk_bytes)
    order = range(n) if forward else range(n - 1, -1, -1)
    steps = tuple(Step(i, _part(out_bytes, i, chunk_bytes), _part(in_bytes, i, chunk_bytes)) for i in order)
    return RotationPlan(out_bytes, in_bytes, chunk_bytes, ring_depth, forward, in_offset, out_offset, need, steps)


def _part(total: int, i: int, c: int) -> int:
    return max(0, min(c, total - i * c))
