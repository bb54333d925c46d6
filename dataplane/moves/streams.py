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


class _OnStream:
    """``with``: make a stream the current one of its device; on exit, the one before it again.

    What ``torch.cuda.stream(s)`` does for a stream of the thread's current device, through the
    two calls it ends in: torch's context manager also looks the current device up (twice) and
    builds a Stream object for the stream it replaces (~10 µs of host time per use on the H200's host;
    a move switches streams 5-40 times, a one-block move's begin is ~0.3 ms of host time).
    Used only where the thread's current device is the stream's (``CopyStreams.on`` checks);
    a new one per use, so nesting is safe."""

    __slots__ = ("_ids", "_prev")

    def __init__(self, ids: tuple[int, int, int]):
        self._ids = ids

    def __enter__(self) -> None:
        self._prev = _get_stream(self._ids[1])
        _set_stream(*self._ids)

    def __exit__(self, *exc) -> None:
        _set_stream(*self._prev)


_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


class CopyStreams:
    def __init__(self, device: torch.device, fast_switch: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        # streams switched through _OnStream (False: torch.cuda.stream, for comparison)
        self.fast_switch = fast_switch and None not in (_get_stream, _set_stream, _get_device)
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
            self.index = self.d2h.device_index
            self._ids = {id(st): (st.stream_id, st.device_index, st.device_type) for st in self.all()}
        else:
            self.d2h = self.h2d = self.hash = self.stage_d2h = self.stage_h2d = self.small = None
            self.zero_index = torch.zeros(1, dtype=torch.int64)

    def all(self) -> tuple:
        return (self.d2h, self.h2d, self.hash, self.stage_d2h, self.stage_h2d, self.small)

    def compute_stream(self):
        """The caller's current stream (the model's compute stream), or None on CPU."""
        if not self.cuda:
            return None
        if self.fast_switch:
            sid, index, dtype = _get_stream(self.index)
            return torch.cuda.Stream(stream_id=sid, device_index=index, device_type=dtype)
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        """A context in which ``stream`` (one of these streams, or a stream of this device) is current."""
        if not self.cuda:
            return contextlib.nullcontext()
        if self.fast_switch and _get_device() == self.index:
            ids = self._ids.get(id(stream)) or (stream.stream_id, stream.device_index, stream.device_type)
            if ids[1] == self.index:
                return _OnStream(ids)
        return torch.cuda.stream(stream)

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
