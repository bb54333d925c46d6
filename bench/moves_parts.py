"""Pieces of bench/moves.py that other benches use too (moves_probe, moves_trace): timing that
waits for the device, a move's phase durations, a block with the checksums switched off, and
the probe of where "both at once" loses against the bidirectional ceiling."""
from __future__ import annotations

import statistics
import time

import torch

from residency.dataplane.moves.copy import Copier

GB = 1e9


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev, fn) -> float:
    """Seconds from enqueue until the host sees completion."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def phases(marks: dict) -> dict:
    """Host-clock phase durations (µs) of one move from Mover.last_phases."""
    order = ["submitted", "validated", "enqueued", "landed", "settled"]
    names = ["validate", "begin", "wait", "commit"]
    out = {n: (marks[b] - marks[a]) / 1e3 for n, a, b in zip(names, order, order[1:]) if a in marks and b in marks}
    # inside begin: slots reserved, first chunk's copy enqueued (the link can start), the rest
    if all(k in marks for k in ("validated", "reserved", "first_chunk", "enqueued")):
        out["begin.reserve"] = (marks["reserved"] - marks["validated"]) / 1e3
        out["begin.first_chunk"] = (marks["first_chunk"] - marks["reserved"]) / 1e3
        out["begin.rest"] = (marks["enqueued"] - marks["first_chunk"]) / 1e3
    return out


class no_checksums:
    """Within the block, device<->host moves skip hashing (checksums read as 0): the bench's way
    of measuring what the checksum itself costs. Never used outside bench/."""

    def __enter__(self):
        import residency.dataplane.moves.device_host as dh

        from residency.dataplane.moves.indexes import Landed

        class Part:
            def __init__(self, n):
                self.n = n

            def numel(self):
                return self.n

        class NoHash:
            def __init__(self, ctx, words, slots, ids):
                self.ctx, self.n, self.parts, self.marks = ctx, len(list(ids)), [], []

            def enqueue(self, lo, hi, after=None):
                self.parts.append(Part(hi - lo))
                self.marks.append(after)         # a restore's chunk copy: what its hash would wait on

            def done(self, spin=False):
                return self.ctx.streams.mark(self.ctx.streams.hash, spin)

            def land(self, lo=0, hi=None, spin=False):
                # what the real one waits for: the copy of the parts' chunks, and no hashing
                s = self.ctx.streams
                parts = self.parts[lo:hi]
                after = self.marks[len(self.parts[:hi]) - 1] if parts else None
                if after is not None:
                    s.wait_event(s.small, after)
                ev = s.mark(s.small, spin)
                n = sum(p.n for p in self.parts[lo:hi])
                return Landed([0] * n, None, None) if not s.cuda else _Done0(ev, n)

            def values(self):
                return [0] * self.n

        class _Done0:
            def __init__(self, ev, n):
                self.ev, self.n = ev, n

            def read(self):
                self.ev.synchronize()
                return [0] * self.n

        self.dh, self.saved = dh, dh.Hasher
        dh.Hasher = NoHash
        return self

    def __exit__(self, *exc):
        self.dh.Hasher = self.saved


def probe_bidir(b) -> None:
    """Where does "both at once" lose against the bidirectional ceiling? The same 2 GiB each
    way through ever more of the mover's machinery, aggregate GB/s:

      plain_default_streams   one copy per direction on two fresh default-priority streams
      plain_engine_streams    the same on the mover's (high-priority) d2h / h2d streams
      chunked_64MiB           32 copies of 64 MiB per direction, engine streams
      copy_path_<mode>        the mover's Copier both ways (gather/scatter + DMA), no bookkeeping
    """
    d = b.dev
    if d.type != "cuda":
        return
    ctx, dp, hp = b.e.ctx, b.e.device_pool, b.e.host_pool
    s = ctx.streams
    h_a, h_b, reps = b.h_a.tensor, b.h_b.tensor, b.args.reps
    out: dict = {}

    def agg(fn) -> float:
        return 2 * b.bytes / statistics.median(timed(d, fn) for _ in range(reps)) / GB

    f1, f2 = torch.cuda.Stream(d), torch.cuda.Stream(d)

    def plain(sa, sb):
        def go():
            with torch.cuda.stream(sa):
                h_b.copy_(b.d_a, non_blocking=True)
            with torch.cuda.stream(sb):
                b.d_b.copy_(h_a, non_blocking=True)
        return go

    def chunked():
        step = max(1, (64 << 20) // b.layout.block_bytes)
        for lo in range(0, b.n, step):
            with torch.cuda.stream(s.d2h):
                h_b[lo:lo + step].copy_(b.d_a[lo:lo + step], non_blocking=True)
            with torch.cuda.stream(s.h2d):
                b.d_b[lo:lo + step].copy_(h_a[lo:lo + step], non_blocking=True)

    out["plain_default_streams_GBps"] = agg(plain(f1, f2))
    out["plain_engine_streams_GBps"] = agg(plain(s.d2h, s.h2d))
    out["chunked_64MiB_GBps"] = agg(chunked)
    b.run(b.mv("evict", "device", "host", b.A))       # A on the host, B on the device
    try:
        for mode in ("staged", "dma"):
            ctx.copy_modes.update(d2h=mode, h2d=mode)
            b_dev = dp.slots_of(b.B)
            free_host = sorted(hp.table._free)[: b.n]
            a_host = sorted(hp.slots_of(b.A))
            free_dev = sorted(dp.table._free)[: b.n]

            def go():
                out_c = Copier(ctx, "d2h", dp.words, b_dev, hp.words, free_host)
                in_c = Copier(ctx, "h2d", hp.words, a_host, dp.words, free_dev)
                out_c.enqueue(0, b.n)
                in_c.enqueue(0, b.n)
                out_c.done().synchronize()
                in_c.done().synchronize()
            out[f"copy_path_{mode}_GBps"] = agg(go)
    finally:
        b.run(b.mv("restore", "host", "device", b.A))
    for k in list(out):
        out[k.replace("_GBps", "_fraction_of_ceiling")] = b.frac(out[k], b.res["ceiling_bidir_GBps"])
    b.res["bidir_probe"] = out


def both_over_one(both_wall: float, out_wall: float, in_wall: float) -> float:
    """Both directions at once (the same bytes each way) over the mean of one way out and one way
    in, as rates: (2 / both) / ((1 / out + 1 / in) / 2)."""
    return (2 / both_wall) / ((1 / out_wall + 1 / in_wall) / 2)
