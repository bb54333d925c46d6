"""The two ways a move copies whole blocks between the device pool and the host pool.

    "kernel"  one Triton launch for the whole move: ``gather_blocks`` stores device rows straight
              into the pinned host pool (spill), ``scatter_blocks`` loads pinned host rows straight
              into device slots (restore). No staging, one launch, ~zero host CPU per block.
    "dma"     one cudaMemcpyAsync per run of consecutive slots (a block-first block is one
              contiguous span, so a run is ≥ block_bytes = 2 MiB for real models, long enough to
              run the copy engine near its peak). Uses no SMs; costs a few µs of host CPU per run.

Both are enqueued on the caller-chosen copy stream and complete in stream order. The engine
picks one per direction (``Engine(copy_modes=...)``); bench/moves.py measures both.
On CPU both run synchronously (the kernel path through the torch references, or Triton's
interpreter under TRITON_INTERPRET=1).
"""
from __future__ import annotations

from collections.abc import Sequence

from kernels.gather import gather_blocks
from kernels.scatter import scatter_blocks

COPY_MODES = ("kernel", "dma")


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
    """Whole-block copies between the device pool and the host pool for one move, by chunks."""

    def __init__(self, ctx, direction: str, src_words, src_slots, dst_words, dst_slots):
        self.ctx = ctx
        self.direction = direction
        self.stream = ctx.streams.d2h if direction == "d2h" else ctx.streams.h2d
        self.src_words, self.dst_words = src_words, dst_words
        self.src_slots, self.dst_slots = list(src_slots), list(dst_slots)
        self.mode = ctx.copy_modes[direction]
        self.dev_idx = None
        if self.mode == "kernel":
            self.dev_idx = ctx.indexes[direction].upload(self.stream, self.src_slots, self.dst_slots)

    def enqueue(self, lo: int, hi: int) -> None:
        s = self.ctx.streams
        if self.mode == "dma":
            with s.on(self.stream):
                for a, b, n in coalesce(self.src_slots[lo:hi], self.dst_slots[lo:hi]):
                    self.dst_words[b : b + n].copy_(self.src_words[a : a + n], non_blocking=True)
            return
        si, di = self.dev_idx[0][lo:hi], self.dev_idx[1][lo:hi]
        with s.on(self.stream):
            if self.direction == "d2h":
                gather_blocks(self.src_words, si, self.dst_words, out_rows=di)
            else:
                scatter_blocks(self.src_words, self.dst_words, di, src_rows=si)
