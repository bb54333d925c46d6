"""Copy streams and completion events: one stream per direction, one for hashing.

    caller's compute stream ──(wait)──► d2h stream:  device → host copies (spill, evict, park)
                            ──(wait)──► h2d stream:  host → device copies (restore)
                            ──(wait)──► hash stream: checksums, after (or beside) the copies
                            ──(wait)──► stage_d2h / stage_h2d: the gather/scatter kernels of the
                                        "staged" copy mode, overlapping the DMA of the chunk before

Copies never run on the compute stream, so they overlap the model's kernels; each copy stream
first waits for the work already queued on the caller's stream (the producer of the bytes a
spill reads, and the last readers of the slots a restore overwrites).
NOTE (vllm#45704): a restore's blocks become visible only after the host has waited on the
event recorded after its last copy and its checksums matched; the compute stream is then also
made to wait on that event, so no kernel can read a restored page before its bytes landed.

Lanes: the "dma" copy mode may spread a move's chunks over several streams per direction
(``dma_lanes``; the first lane is d2h / h2d itself). A copy engine finishes one DMA before it
starts the next, so a stream of 2 MiB DMAs idles the link for a read latency at every boundary;
two streams let two copy engines overlap those boundaries (bench/moves_lanes.py measures it).
Every lane waits on the compute stream as its first lane does, and a move's ``done()`` joins
its lanes back into the first one, so everything after it (checksums, the next chunk's waits,
the move's completion event) sees all of them.

Completion events are created with ``blocking=True``: a waiting host thread sleeps instead of
spinning, so host CPU time per GiB moved measures work, not polling.
On CPU every operation runs synchronously; ``Done`` stands in for an event.
"""
from __future__ import annotations

import contextlib

import torch


class Done:
    """An already-completed event (CPU path)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CopyStreams:
    def __init__(self, device: torch.device, lanes: int = 1):
        if lanes < 1:
            raise ValueError(f"dma lanes must be >= 1, got {lanes}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.max_lanes = lanes          # streams made per direction
        self.dma_lanes = lanes          # of which the "dma" copy mode uses this many (<= max_lanes)
        if self.cuda:
            # Copy and staging streams get the highest priority: their kernels are short, and
            # the block scheduler then runs them ahead of queued compute or hashing blocks, so
            # the DMA pipeline never starves. Hashing runs at normal priority in the gaps.
            hi = -8   # out-of-range priorities clamp to the highest the device has
            self.d2h = torch.cuda.Stream(device, priority=hi)
            self.h2d = torch.cuda.Stream(device, priority=hi)
            self.stage_d2h = torch.cuda.Stream(device, priority=hi)
            self.stage_h2d = torch.cuda.Stream(device, priority=hi)
            self.hash = torch.cuda.Stream(device)
            # Small transfers (slot indices up, checksums down) run as kernels on this stream,
            # never as DMAs: a DMA would queue on a copy engine behind a move's 64 MiB chunks.
            self.small = torch.cuda.Stream(device, priority=hi)
            self.zero_index = torch.zeros(1, dtype=torch.int64, device=device)
            self._lanes = {"d2h": [self.d2h] + [torch.cuda.Stream(device, priority=hi) for _ in range(lanes - 1)],
                           "h2d": [self.h2d] + [torch.cuda.Stream(device, priority=hi) for _ in range(lanes - 1)]}
        else:
            self.d2h = self.h2d = self.hash = self.stage_d2h = self.stage_h2d = self.small = None
            self.zero_index = torch.zeros(1, dtype=torch.int64)
            self._lanes = {"d2h": [None], "h2d": [None]}

    def all(self) -> tuple:
        extra = tuple(self._lanes["d2h"][1:] + self._lanes["h2d"][1:]) if self.cuda else ()
        return (self.d2h, self.h2d, self.hash, self.stage_d2h, self.stage_h2d, self.small) + extra

    def lanes(self, direction: str) -> list:
        """The streams the "dma" copy mode spreads a move's chunks over, first lane first."""
        lanes = self._lanes[direction]
        return lanes[: max(1, min(self.dma_lanes, len(lanes)))]

    def with_lanes(self, stream) -> list:
        """``stream`` and, when it is a direction's first lane, the other lanes of that direction."""
        for lanes in self._lanes.values():
            if self.cuda and stream is lanes[0]:
                return lanes
        return [stream]

    def join(self, stream, others) -> None:
        """Make ``stream`` wait for the work queued so far on each of ``others``."""
        if self.cuda:
            for other in others:
                if other is not stream:
                    stream.wait_stream(other)

    def compute_stream(self):
        """The caller's current stream (the model's compute stream), or None on CPU."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait_stream(self, stream, other) -> None:
        if self.cuda and other is not None:
            stream.wait_stream(other)

    def wait_event(self, stream, event) -> None:
        if self.cuda and not isinstance(event, Done):
            stream.wait_event(event)

    def mark(self, stream, spin: bool = False):
        """An event recorded on ``stream`` now, or Done on CPU.

        Blocking-sync by default: a host waiting on it sleeps. ``spin=True`` makes one the host
        polls instead: waking from a blocking wait costs tens of µs or more, so a move sleeps
        until its last chunk is under way (a blocking event before it) and spins only on that
        chunk's event (one chunk's time of host CPU, ~1 ms, for a faster wake at the end).
        """
        if not self.cuda:
            return Done()
        ev = torch.cuda.Event(blocking=not spin)
        ev.record(stream)
        return ev
