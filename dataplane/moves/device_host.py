"""Moves between the device pool and the pinned host pool: spill/evict/park out, restore in.

Spill (device -> host), in chunks of pipeline_blocks blocks:

    compute ──► d2h:  copy c0 ─► copy c1 ─► copy c2 ... ──────────────► e_copy ─┐
            └─► hash: psum64 of every device source row (beside the copies) ─► e_hash ─┤
    finish: wait e_hash, record the checksums on the reserved host slots (the link is
    still busy); wait e_copy; publish the host copies, free the source if asked.

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


# Chunks a move enqueues inside begin(); the rest wait in ``pending`` for Engine.pump / finish.
# Two chunks keep the link busy (~2.4 ms at 55 GB/s for 64 MiB chunks) while the caller goes on.
PRIME_CHUNKS = 2


class SpillToHost(InFlight):
    route = ("device", "host")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.dslots = c.device.slots_of(self.ids)
        self.hslots = c.host.reserve(self.ids)
        # The bytes we read were written by work queued on the compute stream.
        self.after_compute(s.hash, s.d2h, s.stage_d2h)
        self.pending = self._chunks()
        self.advance(PRIME_CHUNKS)

    def _chunks(self):
        c = self.ctx
        copier = Copier(c, "d2h", c.device.words, self.dslots, c.host.words, self.hslots)
        step, n = max(1, c.pipeline_blocks), len(self.ids)
        # Copy first: the link is the bottleneck, so it must start before anything else is queued.
        copier.enqueue(0, min(n, step))
        # The checksums read the device source (which stays put until commit) beside the copies.
        self.hasher = Hasher(c, c.device.words, self.dslots, self.ids)
        self.hasher.enqueue(0, n)
        self.hashed = self.hasher.done()
        self.nearly = copier.done()
        yield
        for lo in range(step, n, step):
            self.nearly = copier.done()          # the link is busy with the chunks before this one
            copier.enqueue(lo, min(n, lo + step))
            yield
        self.copied = copier.done(spin=True)

    def finish(self):
        c = self.ctx
        self.enqueue_rest()
        # The checksums of the source land long before the copy: record them on the reserved
        # host slots while the link is still busy, so only publish and free remain after it.
        self.hashed.synchronize()
        sums = self.hasher.values()
        c.host.set_checksums(self.ids, sums)
        # Check the commit now (it cannot change before the copy lands: one thread), apply it then.
        ready = c.host.table.can_publish(self.ids)
        free_now = not self.cmd.keep_source and c.device.table.can_free_all(self.ids)
        self.nearly.synchronize()                # sleep while all but the last chunk cross
        self.copied.synchronize()                # spin through the last one: a prompt wake
        self.mark("landed")
        self.bytes_moved = len(self.ids) * c.layout.block_bytes
        if ready:
            c.host.table.publish_checked(self.ids)
        else:
            c.host.publish(self.ids)             # raises, naming what is wrong
        self.hslots = None
        freed = c.device.table.free_all_checked(self.ids) if free_now else self.free_source()
        return self.acked(freed, sums)

    def rollback(self) -> None:
        if getattr(self, "hslots", None) is not None:
            self.ctx.host.cancel(self.ids)
            self.hslots = None


class RestoreFromHost(InFlight):
    route = ("host", "device")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        hslots = c.host.slots_of(self.ids)
        self.dslots = c.device.reserve(self.ids)
        # NOTE: the reserved slots may have been freed while kernels queued on the compute stream
        # still read their old contents; the copy must not overwrite them before those finish.
        self.after_compute(s.h2d, s.stage_h2d)
        # Walk the blocks in host-slot order: host runs get long (fewer, larger DMAs); the device
        # side is scattered anyway. Checksums are mapped back to the command's order at the end.
        order = sorted(range(len(self.ids)), key=hslots.__getitem__)
        self.order_ids = [self.ids[i] for i in order]
        back = [0] * len(order)                  # command position -> position in walk order
        for k, i in enumerate(order):
            back[i] = k
        self.back = back
        self.pending = self._chunks([hslots[i] for i in order], [self.dslots[i] for i in order])
        self.advance(PRIME_CHUNKS)
        self.expected = c.host.checksums_of(self.ids)     # after the first chunks: off the link's path

    def _chunks(self, src_slots, dst_slots):
        c = self.ctx
        copier = Copier(c, "h2d", c.host.words, src_slots, c.device.words, dst_slots)
        self.hasher = Hasher(c, c.device.words, dst_slots, self.order_ids)
        step, n = max(1, c.pipeline_blocks), len(self.ids)
        self.nearly = None
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            if hi == n and lo > 0:
                self.nearly = self.hasher.done()  # every chunk before the last one verified
            copier.enqueue(lo, hi)
            self.hasher.enqueue(lo, hi, after=copier.done())
            yield
        self.copied = copier.done()
        self.hashed = self.hasher.done(spin=True)

    def finish(self):
        c, s = self.ctx, self.ctx.streams
        self.enqueue_rest()
        # Check the commit now (it cannot change before the copy lands: one thread), apply it then.
        ready = c.device.table.can_publish(self.ids)
        free_now = not self.cmd.keep_source and c.host.table.can_free_all(self.ids)
        if self.nearly is not None:
            self.nearly.synchronize()            # sleep while all but the last chunk cross
        self.copied.synchronize()
        self.hashed.synchronize()                # spin through the last one: a prompt wake
        self.mark("landed")
        self.bytes_moved = len(self.ids) * c.layout.block_bytes
        walked = self.hasher.values()
        got = list(map(walked.__getitem__, self.back))
        if got != self.expected:
            bad = [(b, e, g) for b, e, g in zip(self.ids, self.expected, got) if e != g]
            self.rollback()
            return self.failed(str(ChecksumMismatch("restore host->device", bad)))
        if ready:
            c.device.table.publish_checked(self.ids)
        else:
            c.device.publish(self.ids)           # raises, naming what is wrong
        self.dslots = None
        s.wait_event(self.compute, self.hashed)   # no compute kernel reads a page before it landed
        if free_now:
            freed = c.host.table.free_all_checked(self.ids)
            c.host.drop_checksums(self.ids)
        else:
            freed = self.free_source()
        return self.acked(freed, got)

    def rollback(self) -> None:
        if getattr(self, "dslots", None) is not None:
            self.ctx.device.cancel(self.ids)
            self.dslots = None
