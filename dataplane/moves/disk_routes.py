"""Moves that touch the disk tier: device<->disk through the pinned staging ring, host<->disk direct.

    spill to disk     hash device rows ─► per block: DMA row -> ring[k] ─► host writes file k
                      (ring of R pinned rows: block i+R's copy is queued while block i is written)
    restore from disk per block: host reads file -> ring[k] ─► DMA ring[k] -> reserved device slot
                      then hash the device rows; compare with each file's header checksum
    demote            hash the host copies (on the GPU through the mapped pinned pages; on CPU by
                      the reference) and refuse to write a copy that no longer matches its
                      checksum; write files straight from the pinned host rows
    promote           read files straight into reserved (pinned) host rows, hash them, compare
                      with the headers; publish only if every block matches

Files become visible by rename only at commit, so a failed move leaves no file behind. A file
found missing during a read is forgotten by the index (its bytes are gone); a damaged one stays
indexed, like a corrupted host copy, until the control plane releases it.
"""
from __future__ import annotations

from residency.dataplane.moves.base import Hasher, InFlight
from residency.dataplane.pools.errors import ChecksumMismatch, DiskCopyError


class _DiskWriter(InFlight):
    """Shared rollback for moves that write disk files."""

    def rollback(self) -> None:
        if getattr(self, "disk_reserved", False):
            self.ctx.disk.cancel(self.ids)
            self.disk_reserved = False


class _DiskReader(InFlight):
    def read_failed(self, e: DiskCopyError):
        if e.reason == "is missing":
            self.ctx.disk.forget(e.block_id)
        self.abort()
        return self.failed(str(e))


class SpillToDisk(_DiskWriter):
    route = ("device", "disk")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.dslots = c.device.slots_of(self.ids)
        c.disk.reserve(self.ids)
        self.disk_reserved = True
        self.after_compute(s.hash, s.d2h)
        self.hasher = Hasher(c, c.device.words, self.dslots, self.ids)
        self.hasher.enqueue(0, len(self.ids))
        self.hashed = self.hasher.done()

    def finish(self):
        with self.ctx.ring.lock:             # the ring's rows are this move's until it returns
            return self._finish_through_ring()

    def _finish_through_ring(self):
        c, s = self.ctx, self.ctx.streams
        ring, n = c.ring, len(self.ids)
        self.hashed.synchronize()
        sums = self.hasher.values()

        def enqueue(i: int) -> None:
            k = i % ring.num_slots
            row = ring.acquire(k)
            with s.on(s.d2h):
                row.copy_(c.device.words[self.dslots[i]], non_blocking=True)
            ring.release_after(k, s.d2h)

        for i in range(min(ring.num_slots, n)):
            enqueue(i)
        self.bytes_moved = 0
        for i, b in enumerate(self.ids):
            k = i % ring.num_slots
            ring.event(k).synchronize()
            self.bytes_moved += c.disk.write(b, ring.rows[k], sums[i])
            if i + ring.num_slots < n:
                enqueue(i + ring.num_slots)
        c.disk.publish(self.ids)
        self.disk_reserved = False
        return self.acked(self.free_source(), sums)


class RestoreFromDisk(_DiskReader):
    route = ("disk", "device")
    reserved_slots = "dslots"

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.indexed = [c.disk.checksum_of(b) for b in self.ids]
        self.dslots = c.device.reserve(self.ids)
        self.after_compute(s.h2d)   # see RestoreFromHost: old readers of these slots

    def finish(self):
        with self.ctx.ring.lock:             # the ring's rows are this move's until it returns
            return self._finish_through_ring()

    def _finish_through_ring(self):
        c, s = self.ctx, self.ctx.streams
        ring = c.ring
        headers: list[int] = []
        self.bytes_moved = 0
        for i, b in enumerate(self.ids):
            k = i % ring.num_slots
            row = ring.acquire(k)
            try:
                got, header_sum = c.disk.read_into(b, row)
            except DiskCopyError as e:
                return self.read_failed(e)
            if header_sum != self.indexed[i]:
                self.abort()
                return self.failed(f"disk copy of block {b} changed since it was indexed: header "
                                   f"{header_sum:#018x}, index {self.indexed[i]:#018x}")
            headers.append(header_sum)
            with s.on(s.h2d):
                c.device.words[self.dslots[i]].copy_(row, non_blocking=True)
            ring.release_after(k, s.h2d)
            self.bytes_moved += got
        hasher = Hasher(c, c.device.words, self.dslots, self.ids)
        hasher.enqueue(0, len(self.ids), after=s.mark(s.h2d))
        done = hasher.done()
        done.synchronize()
        sums = hasher.values()
        bad = [(b, e, g) for b, e, g in zip(self.ids, headers, sums) if e != g]
        if bad:
            self.abort()
            return self.failed(str(ChecksumMismatch("restore disk->device", bad)))
        c.device.publish(self.ids)
        self.dslots = None
        s.wait_event(self.compute, done)
        return self.acked(self.free_source(), sums)


class Demote(_DiskWriter):
    route = ("host", "disk")

    def begin(self) -> None:
        c = self.ctx
        self.expected = c.host.checksums_of(self.ids)
        self.hslots = c.host.slots_of(self.ids)
        c.disk.reserve(self.ids)
        self.disk_reserved = True
        self.hasher = Hasher(c, c.host.words, self.hslots, self.ids)
        self.hasher.enqueue(0, len(self.ids))
        self.hashed = self.hasher.done()

    def finish(self):
        c = self.ctx
        self.hashed.synchronize()
        got = self.hasher.values()
        bad = [(b, e, g) for b, e, g in zip(self.ids, self.expected, got) if e != g]
        if bad:
            self.abort()
            self.bytes_moved = 0
            return self.failed(str(ChecksumMismatch("demote host->disk (host copy)", bad)))
        self.bytes_moved = 0
        for b, slot, checksum in zip(self.ids, self.hslots, self.expected):
            self.bytes_moved += c.disk.write(b, c.host.words[slot], checksum)
        c.disk.publish(self.ids)
        self.disk_reserved = False
        return self.acked(self.free_source(), self.expected)


class Promote(_DiskReader):
    route = ("disk", "host")
    reserved_slots = "hslots"

    def begin(self) -> None:
        c = self.ctx
        self.indexed = [c.disk.checksum_of(b) for b in self.ids]
        self.hslots = c.host.reserve(self.ids)

    def finish(self):
        c = self.ctx
        headers: list[int] = []
        self.bytes_moved = 0
        for b, slot, indexed in zip(self.ids, self.hslots, self.indexed):
            try:
                got, header_sum = c.disk.read_into(b, c.host.words[slot])
            except DiskCopyError as e:
                return self.read_failed(e)
            if header_sum != indexed:
                self.abort()
                return self.failed(f"disk copy of block {b} changed since it was indexed: header "
                                   f"{header_sum:#018x}, index {indexed:#018x}")
            headers.append(header_sum)
            self.bytes_moved += got
        hasher = Hasher(c, c.host.words, self.hslots, self.ids)
        hasher.enqueue(0, len(self.ids))
        hasher.done().synchronize()
        sums = hasher.values()
        bad = [(b, e, g) for b, e, g in zip(self.ids, headers, sums) if e != g]
        if bad:
            self.abort()
            return self.failed(str(ChecksumMismatch("promote disk->host", bad)))
        c.host.set_checksums(self.ids, sums)
        c.host.publish(self.ids)
        self.hslots = None
        return self.acked(self.free_source(), sums)
