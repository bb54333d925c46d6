"""The two ways a move copies whole blocks between the device pool and the pinned host pool.

    "dma"     one DMA per run of slots consecutive on both sides (a block-first block is one
              contiguous span, so a run is >= block_bytes = 2 MiB for real models). Uses no SMs;
              a few µs of host CPU per run, or one call per chunk where the runtime issues a
              chunk's DMAs in one batch (moves/dma.py).
    "staged"  gather the chunk's scattered device rows into a device staging buffer at HBM speed
              (or scatter out of it), and DMA the staging buffer to/from the host in runs as long
              as the host slots allow: a fresh host pool hands out consecutive slots, and
              restores walk their blocks in host-slot order, so a 32-block chunk is one 64 MiB DMA.
              Two buffers per direction: chunk k+1 is gathered while chunk k crosses PCIe.

    staged spill:   stage_d2h: gather c0 ─► e0  gather c1 ─► e1  ...
                    d2h:        (wait e0) DMA c0 ──► (wait e1) DMA c1 ──► ...
    staged restore: h2d:        DMA c0 ─► e0  DMA c1 ─► e1 ...
                    stage_h2d:  (wait e0) scatter c0 ─► (wait e1) scatter c1 ─► ...

Both are enqueued on copy streams and complete in stream order. A move's first chunk always goes
by "dma" (no index upload before the link starts); the rest by the mode the mover chose for its
DMA issuer (``mover.copy_modes_for``). On CPU they run synchronously, so both are exercised in CI.
"""
from __future__ import annotations

from collections.abc import Sequence

from residency.kernels.gather import gather_blocks_trusted
from residency.kernels.scatter import scatter_blocks_trusted

COPY_MODES = ("dma", "staged")


def coalesce(src_slots: Sequence[int], dst_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs (src_start, dst_start, length) where both sides advance by one slot together.

        src 7 8 9 3 4     dst 0 1 2 3 4   ->   (7, 0, 3), (3, 3, 2)
    """
    runs: list[list[int]] = []
    for s, d in zip(src_slots, dst_slots, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


class Copier:
    """Whole-block copies between the device pool and the host pool for one move, by chunks.

    ``enqueue(lo, hi)`` queues blocks [lo, hi) of the move; ``done()`` is an event after
    everything queued so far has landed (use it to order checksums after the copy).
    """

    def __init__(self, ctx, direction: str, src_words, src_slots, dst_words, dst_slots, mode: str | None = None):
        self.ctx = ctx
        self.direction = direction
        s = ctx.streams
        self.stream = s.d2h if direction == "d2h" else s.h2d
        self.stage = s.stage_d2h if direction == "d2h" else s.stage_h2d
        self.src_words, self.dst_words = src_words, dst_words
        self.src_slots, self.dst_slots = list(src_slots), list(dst_slots)
        self.mode = mode or ctx.copy_modes[direction]
        if self.mode not in COPY_MODES:
            raise ValueError(f"copy mode {self.mode!r} is not one of {COPY_MODES}")
        self.dev_idx = None          # the staging kernels' device slot indices, uploaded by the first enqueue

    def _upload(self) -> None:
        # Not in __init__: a move whose blocks all went in its first chunk (plain DMAs) builds the
        # copier of its remaining chunks and never enqueues one; the upload would be a wasted launch.
        dev_slots = self.src_slots if self.direction == "d2h" else self.dst_slots
        self.dev_idx = self.ctx.indexes[self.direction].upload(self.stage, dev_slots)[0]

    def enqueue(self, lo: int, hi: int) -> None:
        if self.mode == "dma":
            self._dma(self.stream, self.src_words, self.src_slots[lo:hi], self.dst_words, self.dst_slots[lo:hi])
            return
        if self.dev_idx is None:
            self._upload()
        step = self.ctx.staging.rows
        for a in range(lo, hi, step):
            self._staged(a, min(hi, a + step))

    def done(self, spin: bool = False):
        """An event after everything this direction's streams have queued so far for the move."""
        last = self.stage if (self.mode == "staged" and self.direction == "h2d") else self.stream
        return self.ctx.streams.mark(last, spin)

    def _dma(self, stream, src_words, src_slots, dst_words, dst_slots) -> None:
        with self.ctx.streams.on(stream):
            self.ctx.dma.copy_runs(stream, dst_words, src_words, coalesce(src_slots, dst_slots))

    def _staged(self, a: int, b: int) -> None:
        s, st = self.ctx.streams, self.ctx.staging
        i, buf = st.take(self.direction)
        rows = list(range(b - a))
        if self.direction == "d2h":
            s.wait_event(self.stage, st.free["d2h"][i])          # the DMA out of buf has finished
            with s.on(self.stage):                                # the mover's own tables: no re-checks
                gather_blocks_trusted(self.src_words, self.dev_idx[a:b], buf)
            s.wait_event(self.stream, s.mark(self.stage))
            self._dma(self.stream, buf, rows, self.dst_words, self.dst_slots[a:b])
            st.free["d2h"][i] = s.mark(self.stream)
        else:
            s.wait_event(self.stream, st.free["h2d"][i])         # the scatter out of buf has finished
            self._dma(self.stream, self.src_words, self.src_slots[a:b], buf, rows)
            s.wait_event(self.stage, s.mark(self.stream))
            with s.on(self.stage):
                scatter_blocks_trusted(buf, self.dst_words, self.dev_idx[a:b])
            st.free["h2d"][i] = s.mark(self.stage)
