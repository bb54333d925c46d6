"""Copy paths the mover does not take, kept here to measure it against.

    "kernel"  one Triton launch per chunk: ``gather_blocks`` stores device rows straight into the
              pinned host pool (spill), ``scatter_blocks`` loads pinned host rows straight into
              device slots (restore). SMs drive PCIe; no staging; ~no host CPU per block.
    lanes     the "dma" mode's chunks spread round several copy streams per direction, so two
              copy engines can hide each other's gaps between 2 MiB DMAs (bench/moves_lanes.py).

``BenchCopier`` is the mover's ``Copier`` plus these: a bench builds its mover with
``copier=functools.partial(BenchCopier, lanes=Lanes(k))`` and switches modes by
``mover.ctx.copy_modes``. For "dma" and "staged" on one lane every call goes to ``Copier``'s own
code, so the figures of those modes are the product's.
"""
from __future__ import annotations

import torch

from residency.dataplane.moves.copy import Copier
from residency.kernels.gather import gather_blocks
from residency.kernels.scatter import scatter_blocks

BENCH_COPY_MODES = ("kernel", "dma", "staged")


class Lanes:
    """Copy streams per direction for the "dma" mode: the direction's own stream first, then
    ``most - 1`` more (made on first use, as the mover's are, at the highest priority);
    ``count`` of them in use (1: the mover's behaviour)."""

    def __init__(self, most: int = 1, make_stream=None):
        if most < 1:
            raise ValueError(f"dma lanes must be >= 1, got {most}")
        self.most = most
        self.count = most
        self.make_stream = make_stream or (lambda device, direction, k: torch.cuda.Stream(device, priority=-8))
        self._lanes: dict[str, list] | None = None

    def of(self, streams, direction: str) -> list:
        """The lanes in use for ``direction``, first lane first (one stand-in on the CPU)."""
        if self._lanes is None:
            if streams.cuda:
                more = {d: [self.make_stream(streams.device, d, k) for k in range(1, self.most)]
                        for d in ("d2h", "h2d")}
                self._lanes = {"d2h": [streams.d2h] + more["d2h"], "h2d": [streams.h2d] + more["h2d"]}
            else:
                self._lanes = {"d2h": [None], "h2d": [None]}
        lanes = self._lanes[direction]
        return lanes[: max(1, min(self.count, len(lanes)))]


class BenchCopier(Copier):
    def __init__(self, ctx, direction: str, src_words, src_slots, dst_words, dst_slots, mode: str | None = None,
                 *, lanes: Lanes | None = None):
        mode = mode or ctx.copy_modes[direction]
        if mode not in BENCH_COPY_MODES:
            raise ValueError(f"copy mode {mode!r} is not one of {BENCH_COPY_MODES}")
        super().__init__(ctx, direction, src_words, src_slots, dst_words, dst_slots,
                         mode="dma" if mode == "kernel" else mode)
        self.mode = mode
        s = ctx.streams
        self.direction_lanes = lanes.of(s, direction) if lanes is not None else [self.stream]
        # "dma": enqueue k goes on lane k % len(lanes); the first lane is self.stream
        self.lanes = lanes.of(s, direction) if (lanes is not None and mode == "dma") else [self.stream]
        self.turn = 0
        for lane in self.lanes[1:]:
            # as the direction's own stream did before the move's first copy: after the bytes'
            # producers and the slots' last readers on the caller's compute stream
            s.wait_stream(lane, s.compute_stream())

    def _upload(self) -> None:
        if self.mode != "kernel":
            return super()._upload()
        self.dev_idx = self.ctx.indexes[self.direction].upload(self.stream, self.src_slots, self.dst_slots)

    def enqueue(self, lo: int, hi: int) -> None:
        if self.mode == "kernel":
            if self.dev_idx is None:
                self._upload()
            si, di = self.dev_idx[0][lo:hi], self.dev_idx[1][lo:hi]
            with self.ctx.streams.on(self.stream):
                if self.direction == "d2h":
                    gather_blocks(self.src_words, si, self.dst_words, out_rows=di)
                else:
                    scatter_blocks(self.src_words, self.dst_words, di, src_rows=si)
        elif len(self.lanes) > 1:
            lane = self.lanes[self.turn % len(self.lanes)]
            self.turn += 1
            self._dma(lane, self.src_words, self.src_slots[lo:hi], self.dst_words, self.dst_slots[lo:hi])
        else:
            super().enqueue(lo, hi)

    def done(self, spin: bool = False):
        # Every lane of the direction, not only this copier's: a move's first chunk (its own
        # copier) may have gone on lanes its later chunks did not use.
        if len(self.direction_lanes) > 1:
            last = self.stage if (self.mode == "staged" and self.direction == "h2d") else self.stream
            for lane in self.direction_lanes:
                if lane is not last:
                    self.ctx.streams.wait_stream(last, lane)
        return super().done(spin)
