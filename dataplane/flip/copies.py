"""The two copy directions of a rotation: CUDA streams and events, or the same calls done now on a CPU.

Both give the executor the same four operations, in the same order, on the same bytes:
``d2h(dst, src)`` and ``h2d(dst, src, after)`` return a ticket; ``wait(ticket)`` returns when the
copy is done; ``running(ticket)`` says whether the device still works on it (None on the CPU:
not measured — there a copy is done when its call returns).
"""
from __future__ import annotations

import time

import torch


class SyncCopies:
    """CPU: each copy runs inside its call; per-direction time is the sum of the calls."""

    def __init__(self):
        self.d2h_s = 0.0
        self.h2d_s = 0.0

    def begin(self) -> None:
        self.d2h_s = self.h2d_s = 0.0

    def d2h(self, dst: torch.Tensor, src: torch.Tensor):
        t0 = time.perf_counter()
        dst.copy_(src)
        self.d2h_s += time.perf_counter() - t0
        return None

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after) -> object:
        t0 = time.perf_counter()
        dst.copy_(src)
        self.h2d_s += time.perf_counter() - t0
        return None

    def wait(self, ticket) -> None:
        return None

    def running(self, ticket) -> bool | None:
        return None

    def finish(self) -> tuple[float, float]:
        return self.d2h_s, self.h2d_s


class CudaCopies:
    """Two streams, one per direction; an H2D waits on its chunk's D2H on the device (no host stall).
    Per-direction time is the span from the first copy's start to the last one's end on its stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.s_d2h = torch.cuda.Stream(device)
        self.s_h2d = torch.cuda.Stream(device)

    def begin(self) -> None:
        cur = torch.cuda.current_stream(self.device)
        self.s_d2h.wait_stream(cur)
        self.s_h2d.wait_stream(cur)
        self.marks = {"d2h": [None, None], "h2d": [None, None]}

    def _mark(self, which: str, stream, end: bool):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        m = self.marks[which]
        if m[0] is None and not end:
            m[0] = ev
        if end:
            m[1] = ev
        return ev

    def d2h(self, dst: torch.Tensor, src: torch.Tensor):
        with torch.cuda.stream(self.s_d2h):
            if self.marks["d2h"][0] is None:
                self._mark("d2h", self.s_d2h, end=False)
            dst.copy_(src, non_blocking=True)
            return self._mark("d2h", self.s_d2h, end=True)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after):
        with torch.cuda.stream(self.s_h2d):
            if after is not None:
                self.s_h2d.wait_event(after)
            if self.marks["h2d"][0] is None:
                self._mark("h2d", self.s_h2d, end=False)
            dst.copy_(src, non_blocking=True)
            return self._mark("h2d", self.s_h2d, end=True)

    def wait(self, ticket) -> None:
        if ticket is not None:
            ticket.synchronize()

    def running(self, ticket) -> bool | None:
        return None if ticket is None else not ticket.query()

    def finish(self) -> tuple[float, float]:
        self.s_d2h.synchronize()
        self.s_h2d.synchronize()
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(self.s_d2h)
        cur.wait_stream(self.s_h2d)
        out = []
        for which in ("d2h", "h2d"):
            a, b = self.marks[which]
            out.append(a.elapsed_time(b) / 1e3 if a is not None and b is not None else 0.0)
        return out[0], out[1]


def copies_for(device: torch.device):
    return CudaCopies(device) if device.type == "cuda" else SyncCopies()
