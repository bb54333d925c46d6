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
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
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
        else:
            self.d2h = self.h2d = self.hash = self.stage_d2h = self.stage_h2d = self.small = None
            self.zero_index = torch.zeros(1, dtype=torch.int64)

    def all(self) -> tuple:
        return (self.d2h, self.h2d, self.hash, self.stage_d2h, self.stage_h2d, self.small)

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
