"""Moves between the device pool and the pinned host pool: spill/evict/park out, restore in.

Spill (device -> host), one chunk:

    compute ──► d2h:  copy all blocks (kernel or DMA) ──────────────► e_copy ─┐
            └─► hash: psum64 of the device source rows ─────────────► e_hash ─┴─► finish: host
                                                                                 waits, records
                                                                                 checksums,
                                                                                 publishes

Restore (host -> device), chunked so that hashing hides behind copying (blocks walked in
host-slot order, so host runs are long):

    compute ──► h2d:  copy c0 ─► e0   copy c1 ─► e1   copy c2 ─► e2 ...
                        hash: wait e0, hash c0 │ wait e1, hash c1 │ ... ─► e_done
    finish: wait e_done; compare every block's psum64 with the checksum its host copy was
    written under; any mismatch -> cancel the device reservation (pool unchanged) and fail
    naming the blocks; else publish, make the compute stream wait on e_done, free the host
    copy if asked.
"""
from __future__ import annotations

from dataplane.moves.base import Hasher, InFlight
from dataplane.moves.copy import Copier
from dataplane.pools.errors import ChecksumMismatch


class SpillToHost(InFlight):
    route = ("device", "host")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.dslots = c.device.slots_of(self.ids)
        self.hslots = c.host.reserve(self.ids)
        # The bytes we read were written by work queued on the compute stream.
        self.after_compute(s.hash, s.d2h, s.stage_d2h)
        # Copy first: the link is the bottleneck, so it must start before anything else is queued.
        copier = Copier(c, "d2h", c.device.words, self.dslots, c.host.words, self.hslots)
        copier.enqueue(0, len(self.ids))
        self.copied = copier.done()
        self.hasher = Hasher(c, c.device.words, self.dslots, self.ids)
        self.hasher.enqueue(0, len(self.ids))
        self.hashed = self.hasher.done()

    def finish(self):
        c = self.ctx
        self.copied.synchronize()
        self.hashed.synchronize()
        self.mark("landed")
        self.bytes_moved = len(self.ids) * c.layout.block_bytes
        sums = self.hasher.values()
        c.host.set_checksums(self.ids, sums)
        c.host.publish(self.ids)
        self.hslots = None
        return self.acked(self.free_source(), sums)

    def rollback(self) -> None:
        if getattr(self, "hslots", None) is not None:
            self.ctx.host.cancel(self.ids)
            self.hslots = None


class RestoreFromHost(InFlight):
    route = ("host", "device")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.expected = c.host.checksums_of(self.ids)
        hslots = c.host.slots_of(self.ids)
        self.dslots = c.device.reserve(self.ids)
        # NOTE: the reserved slots may have been freed while kernels queued on the compute stream
        # still read their old contents; the copy must not overwrite them before those finish.
        self.after_compute(s.h2d, s.stage_h2d)
        # Walk the blocks in host-slot order: host runs get long (fewer, larger DMAs); the device
        # side is scattered anyway. Checksums are mapped back to the command's order at the end.
        order = sorted(range(len(self.ids)), key=lambda i: hslots[i])
        self.order_ids = [self.ids[i] for i in order]
        copier = Copier(c, "h2d", c.host.words, [hslots[i] for i in order],
                        c.device.words, [self.dslots[i] for i in order])
        self.hasher = Hasher(c, c.device.words, [self.dslots[i] for i in order], self.order_ids)
        step = max(1, c.pipeline_blocks)
        for lo in range(0, len(self.ids), step):
            hi = min(len(self.ids), lo + step)
            copier.enqueue(lo, hi)
            self.hasher.enqueue(lo, hi, after=copier.done())
        self.copied = copier.done()
        self.hashed = self.hasher.done()

    def finish(self):
        c, s = self.ctx, self.ctx.streams
        self.copied.synchronize()
        self.hashed.synchronize()
        self.mark("landed")
        self.bytes_moved = len(self.ids) * c.layout.block_bytes
        by_id = dict(zip(self.order_ids, self.hasher.values()))
        got = [by_id[b] for b in self.ids]
        bad = [(b, e, g) for b, e, g in zip(self.ids, self.expected, got) if e != g]
        if bad:
            self.rollback()
            return self.failed(str(ChecksumMismatch("restore host->device", bad)))
        c.device.publish(self.ids)
        self.dslots = None
        s.wait_event(self.compute, self.hashed)   # no compute kernel reads a page before it landed
        return self.acked(self.free_source(), got)

    def rollback(self) -> None:
        if getattr(self, "dslots", None) is not None:
            self.ctx.device.cancel(self.ids)
            self.dslots = None
