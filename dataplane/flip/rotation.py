"""The rotation executor: flip the arena from its image to the slab's, both directions at once.

The schedule is plan.py's; this module runs it. For each step t (chunk i):

    1. retire the H2D of step t-k (wait for it): its slab range is where this D2H writes
    2. D2H  arena[i]  -> slab[out_offset + i·c]     (the outgoing chunk)
    3. H2D  slab[in_offset + i·c] -> arena[i]       (the incoming chunk), after 2 on the device

Step t+1's D2H is enqueued before step t's H2D is waited on, so with a ring of k ≥ 2 chunks the
link carries both directions at once; with k = 1 step 1 of t+1 waits for t's H2D and nothing
overlaps. ``overlapped_steps`` counts steps whose D2H was enqueued while an earlier H2D had not
been retired yet (the schedule, the same on CPU and GPU); on CUDA ``overlapped_steps_seen`` counts
those where the device was in fact still running that H2D (``event.query()``), None on a CPU.

Before a byte moves: the plan must fit (FlipRefused with its arithmetic), the slab's image must
match its checksums (ChecksumMismatch), and the incoming readers must accept its manifest
(ReaderRefused). After: the arena is checked against the incoming image's checksums and the slab
against the outgoing one's; only if both match are the readers bound to the new generation.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from residency.dataplane.flip.arena import WeightsArena
from residency.dataplane.flip.copies import copies_for
from residency.dataplane.flip.errors import FlipRefused
from residency.dataplane.flip.image import Image
from residency.dataplane.flip.plan import RotationPlan, plan_rotation
from residency.dataplane.flip.readers import WeightsReader
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.pools.errors import ChecksumMismatch, IntegrityError
from residency.events.catalog import FlipCompleted


@dataclass(frozen=True)
class FlipResult:
    """What one flip did and measured. ``fields_for_event`` fills FlipCompleted."""

    from_model: str
    to_model: str
    from_gen: int
    to_gen: int | None            # None: the readers were not rebound (checksum failed)
    bytes_out: int                # measured: bytes copied device -> host
    bytes_in: int                 # measured: bytes copied host -> device
    steps: int
    ring_depth: int
    chunk_bytes: int
    forward: bool
    overlapped_steps: int
    overlapped_steps_seen: int | None
    started_ns: int
    finished_ns: int
    wall_s: float                 # the rotation's copies, enqueue of the first to the end of the last
    d2h_s: float                  # per direction: stream span on CUDA, sum of the copies on a CPU
    h2d_s: float
    verify_before_s: float
    verify_after_s: float
    checksum_ok: bool
    mismatches: tuple[str, ...] = ()

    @property
    def bandwidth_Bps(self) -> float:
        return (self.bytes_out + self.bytes_in) / self.wall_s if self.wall_s > 0 else 0.0

    def fields_for_event(self) -> dict:
        return dict(bytes_out=self.bytes_out, bytes_in=self.bytes_in, started_ns=self.started_ns,
                    finished_ns=self.finished_ns, overlapped_steps=self.overlapped_steps,
                    checksum_ok=self.checksum_ok)

    def to_event(self, flip_id: str) -> FlipCompleted:
        return FlipCompleted(flip_id=flip_id, **self.fields_for_event())


class RotationExecutor:
    """Flips ``arena`` and ``slab`` between the two images they hold. Owns no memory of its own:
    the ring is the slab's overshoot, sized when the slab was made (HostSlab.capacity_for)."""

    def __init__(self, arena: WeightsArena, slab: HostSlab, chunk_bytes: int, ring_depth: int = 2,
                 clock_ns=time.monotonic_ns):
        self.arena = arena
        self.slab = slab
        self.chunk_bytes = int(chunk_bytes)
        self.ring_depth = int(ring_depth)
        self.clock_ns = clock_ns
        self.copies = copies_for(arena.device)
        self.num_flips = 0

    def check_integrity(self) -> None:
        """The arena and the slab each hold a whole image between flips (a flip that raised in the
        middle of its copies leaves neither: both are then unusable until reloaded)."""
        self.arena.check_integrity()
        self.slab.check_integrity()
        if self.arena.image is None or self.slab.image is None:
            raise IntegrityError(f"after {self.num_flips} flips the arena holds "
                                 f"{getattr(self.arena.image, 'model', None)} and the slab "
                                 f"{getattr(self.slab.image, 'model', None)}: a flip was torn")

    def plan(self) -> RotationPlan | FlipRefused:
        """The next flip's plan, or its refusal. Pure over the arena's and slab's current sizes."""
        if self.arena.image is None or self.slab.image is None:
            raise IntegrityError("a flip needs an image in the arena and one in the slab")
        return plan_rotation(self.arena.image.nbytes, self.slab.image.nbytes, self.slab.offset, self.chunk_bytes,
                             self.ring_depth, self.slab.capacity_bytes, self.arena.capacity_bytes)

    def flip(self, readers: Sequence[WeightsReader] = (), verify_before: bool = True,
             to_gen: int | None = None) -> FlipResult:
        """Swap the arena's image and the slab's; bind ``readers`` (the incoming model's) to the new
        generation (``to_gen``, else one on). Refusals raise before anything moves; see the module
        docstring."""
        plan = self.plan()
        if isinstance(plan, FlipRefused):
            raise plan
        if (why := self.arena.gen_refusal(to_gen)) is not None:
            raise IntegrityError(why)
        incoming = self.slab.image
        self.arena.check_readers(readers, incoming.manifest)
        t0 = time.perf_counter()
        if verify_before:
            self.slab.verify()
        # the outgoing image is checked when it lands in the slab: its sums must exist before it leaves
        outgoing = self.arena.seal()
        verify_before_s = time.perf_counter() - t0
        from_gen = self.arena.gen
        self.arena.detach()
        self.slab.image = None                  # mid-flight the slab holds neither image whole
        started_ns = self.clock_ns()
        t0 = time.perf_counter()
        moved_out, moved_in, overlapped, seen, d2h_s, h2d_s = self._rotate(plan)
        wall_s = time.perf_counter() - t0
        finished_ns = self.clock_ns()
        self.slab.image, self.slab.offset = outgoing, plan.out_offset
        self.arena.image = incoming
        t0 = time.perf_counter()
        bad = []
        for what in (self.arena, self.slab):
            try:
                what.verify()
            except ChecksumMismatch as e:
                bad.append(str(e))
        verify_after_s = time.perf_counter() - t0
        bound_gen = None
        if not bad:
            self.arena.install(incoming, readers, to_gen)
            bound_gen = self.arena.gen
        else:
            self.arena.image = None             # the arena's bytes are not the image: no reader binds
        self.num_flips += 1
        return FlipResult(outgoing.model, incoming.model, from_gen, bound_gen, moved_out, moved_in, len(plan.steps),
                          plan.ring_depth, plan.chunk_bytes, plan.forward, overlapped, seen, started_ns, finished_ns,
                          wall_s, d2h_s, h2d_s, verify_before_s, verify_after_s, not bad, tuple(bad))

    def _rotate(self, plan: RotationPlan):
        """Run the plan's steps; returns bytes out, bytes in, overlap (schedule, seen), per-direction seconds."""
        arena, host, cp, c = self.arena.buffer, self.slab.bytes, self.copies, plan.chunk_bytes
        cp.begin()
        pending: deque[tuple[int, object]] = deque()    # (step, ticket) of H2Ds not retired yet
        moved_out = moved_in = overlapped = 0
        seen: int | None = 0 if arena.is_cuda else None
        for t, st in enumerate(plan.steps):
            # NOTE: the slab range this D2H writes held the incoming chunk of step t-k: that H2D
            # must be done before the D2H is enqueued, or the D2H overwrites bytes not yet sent.
            while pending and pending[0][0] <= t - plan.ring_depth:
                cp.wait(pending.popleft()[1])
            a0 = st.chunk * c
            d2h = None
            if st.out_bytes:
                if pending:
                    overlapped += 1
                    if seen is not None and any(cp.running(tk) for _, tk in pending):
                        seen += 1
                o0 = plan.out_offset + a0
                d2h = cp.d2h(host[o0: o0 + st.out_bytes], arena[a0: a0 + st.out_bytes])
                moved_out += st.out_bytes
            if st.in_bytes:
                i0 = plan.in_offset + a0
                pending.append((t, cp.h2d(arena[a0: a0 + st.in_bytes], host[i0: i0 + st.in_bytes], after=d2h)))
                moved_in += st.in_bytes
        while pending:
            cp.wait(pending.popleft()[1])
        d2h_s, h2d_s = cp.finish()
        return moved_out, moved_in, overlapped, seen, d2h_s, h2d_s
