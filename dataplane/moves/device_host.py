"""Moves between the device pool and the pinned host pool: spill/evict/park out, restore in.

Both directions start the link first: a move claims its destination slots (a slice off the
free list), copies a first chunk into them by plain DMAs (no index upload, no kernel launch), and only then
writes its per-block maps, uploads its full slot indices and queues its checksums, while those
first bytes cross (the time from command to the first byte on the link is most of a move's
overhead: ~0.3 ms of validation, then this).

Spill (device -> host), in chunks of pipeline_blocks blocks:

    compute ──► d2h:  copy c0 ─► copy c1 ─► copy c2 ... ──────────────► e_copy ─┐
            └─► hash: psum64 of every device source row (beside the copies) ─► e_hash ─┤
    finish: wait e_hash, record the checksums on the reserved host slots; sleep until the last
    chunk is under way; publish the host copies and free the source (the commit, checked
    ahead); spin until e_copy. Nothing outside this call sees the tables before it returns, so
    the commit may precede the last bytes; if that wait fails it is undone exactly.

Restore (host -> device), chunked so that hashing hides behind copying (blocks walked in
host-slot order, so host runs are long):

    compute ──► h2d:  copy c0 ─► e0   copy c1 ─► e1   copy c2 ─► e2 ...
                        hash: wait e0, hash c0 │ wait e1, hash c1 │ ... ─► e_done
    finish: bring the checksums of every chunk but the last home and compare them (the last
    chunk is still crossing); then publish, make the compute stream wait on e_done, free the
    host copy if asked; spin for the last chunk's checksums and compare them. Any mismatch ->
    the commit undone exactly, the device reservation cancelled (pool unchanged), and the move
    fails naming the blocks. A block never becomes visible to anything but this call before
    its bytes landed and matched.
"""
from __future__ import annotations

from residency.dataplane.moves.base import Hasher, InFlight
from residency.dataplane.pools.errors import ChecksumMismatch
from residency.events.catalog import pack_checksums


def first_chunk_blocks(ctx, n: int, chunks: int = 1) -> int:
    """Blocks of a move's first chunk, copied by plain DMAs the moment its slots are claimed:
    ``chunks`` pipelined chunks (64 blocks of 2 MiB cross in ~2.4 ms), long enough to hide the
    rest of the move's bookkeeping behind it (two when two moves share the mover's thread: each
    link must stay busy through both moves' bookkeeping, ~2 ms each)."""
    return min(n, max(1, ctx.pipeline_blocks) * max(1, chunks))


# Chunks a move enqueues inside begin(); the rest wait in ``pending`` for Mover.pump / finish.
# Two chunks keep the link busy (~2.4 ms at 55 GB/s for 64 MiB chunks) while the caller goes on.
PRIME_CHUNKS = 2


class _LinkFirst(InFlight):
    """begin = start (claim slots, first chunk by plain DMAs) + prepare (maps, indices, chunks).

    ``start_in_slices`` is start as a generator, for moves submitted together: it claims and
    enqueues the first slice, then one more slice per step, so the mover can hand the links
    their first bytes in turn (a spill's 64 scattered DMAs take ~0.65 ms to enqueue: the other
    direction should not wait for all of them)."""

    def begin(self) -> None:
        self.start()
        self.prepare(PRIME_CHUNKS)

    def start(self) -> None:
        for _ in self.start_in_slices(1 << 30):
            pass

    def start_in_slices(self, slice_blocks: int, first_chunks: int = 1, lead_blocks: int = 0):
        first = self.claim(first_chunks)
        n0, step = self.n0, max(1, slice_blocks)
        lead = min(n0, max(step, lead_blocks))
        if lead:
            first.enqueue(0, lead)
        for lo in range(lead, n0, step):
            yield
            first.enqueue(lo, min(n0, lo + step))
        self.first_enqueued(first)
        self.mark("first_chunk")

    def claim(self, first_chunks: int = 1):
        """Claim the destination slots; the Copier of the first chunk (``n0`` blocks, plain DMAs)."""
        raise NotImplementedError

    def first_enqueued(self, first) -> None:
        """The whole first chunk is enqueued."""

    def chunked(self) -> bool:
        return self.n0 < len(self.ids)


class SpillToHost(_LinkFirst):
    route = ("device", "host")
    reserved_slots = "hslots"

    def claim(self, first_chunks: int = 1):
        c, s = self.ctx, self.ctx.streams
        ids = self.ids
        # The link starts first: the first chunk's blocks are copied into claimed host slots
        # before any other bookkeeping, which then runs (prepare) while those bytes cross.
        n0 = self.n0 = first_chunk_blocks(c, len(ids), first_chunks)
        self.claimed = c.host.table.claim(len(ids))
        self.mark("reserved")
        # The bytes we read were written by work queued on the compute stream.
        self.after_compute(s.hash, s.d2h, s.stage_d2h)
        # By plain DMAs (one per 2 MiB block): no index upload and no kernel launch before the link starts.
        return c.copier(c, "d2h", c.device.words, c.device.slots_of(ids[:n0]), c.host.words, self.claimed[:n0],
                      mode="dma")

    def prepare(self, prime: int) -> None:
        c, ids = self.ctx, self.ids
        c.host.table.record_reserved(ids, self.claimed)
        self.hslots, self.claimed = self.claimed, None
        self.dslots = c.device.slots_of(ids)
        self.pending = self._chunks(self.n0)
        self.advance(prime)

    def _chunks(self, n0: int):
        c = self.ctx
        copier = c.copier(c, "d2h", c.device.words, self.dslots, c.host.words, self.hslots)
        step, n = max(1, c.pipeline_blocks), len(self.ids)
        self.nearly = copier.done()
        self.last_chunk = n0
        for lo in range(n0, n, step):
            self.nearly = copier.done()          # the link is busy with the chunks before this one
            self.last_chunk = min(n, lo + step) - lo
            copier.enqueue(lo, min(n, lo + step))
            if lo == n0:
                self._hash()                     # once the link has its second chunk
            yield
        if n0 >= n:
            self._hash()
        self.copied = copier.done(spin=True)

    def device_done(self) -> bool:
        """Every chunk enqueued and landed, and the source hashed."""
        return self.pending is None and getattr(self, "copied", None) is not None \
            and self.copied.query() and self.hashed.query()

    def _hash(self) -> None:
        # The checksums read the device source (which stays put until commit) beside the copies.
        c = self.ctx
        self.hasher = Hasher(c, c.device.words, self.dslots, self.ids)
        self.hasher.enqueue(0, len(self.ids))
        self.hashed = self.hasher.done()

    def finish(self):
        c = self.ctx
        self.enqueue_rest()
        # The checksums of the source land long before the copy: record them on the reserved
        # host slots while the link is still busy.
        sums = self.hasher.values()
        c.host.set_checksums(self.ids, sums)
        keep = self.cmd.keep_source
        early = c.host.table.can_publish(self.ids) and (keep or c.device.table.can_free_all(self.ids))
        self.nearly.synchronize()                # sleep while all but the last chunk cross
        self.nearly_done(self.last_chunk)
        self.bytes_moved = len(self.ids) * c.layout.block_bytes
        if not early:                            # publish raises naming what is wrong; free as it can
            self.copied.synchronize()
            self.mark("landed")
            c.host.publish(self.ids)
            self.hslots = None
            return self.acked(self.free_source(), sums)
        # Apply the commit while the last chunk crosses. Nothing can look at the tables before
        # this returns (the mover is one thread), and it returns only after the bytes landed;
        # if the wait fails, both tables are put back exactly and abort() cancels the reservation.
        packed = pack_checksums(sums)            # the ack's, ready before the bytes are
        c.host.table.publish_checked(self.ids)
        freed = 0 if keep else c.device.table.free_all_checked(self.ids)
        try:
            self.copied.synchronize()            # spin through the last chunk: a prompt wake
        except BaseException:
            if not keep:
                c.device.table.unfree_checked(self.ids, self.dslots)
            c.host.table.unpublish_checked(self.ids)
            raise
        self.mark("landed")
        self.hslots = None
        return self.acked(freed, packed)



class RestoreFromHost(_LinkFirst):
    route = ("host", "device")
    reserved_slots = "dslots"

    def claim(self, first_chunks: int = 1):
        c, s = self.ctx, self.ctx.streams
        ids = self.ids
        hslots = c.host.slots_of(ids)
        # Walk the blocks in host-slot order: host runs get long (fewer, larger DMAs). The k-th
        # block walked gets the k-th claimed device slot, so device runs are long too.
        order = sorted(range(len(ids)), key=hslots.__getitem__)
        src = list(map(hslots.__getitem__, order))
        n0 = first_chunk_blocks(c, len(ids), first_chunks)
        self.claimed = c.device.table.claim(len(ids))
        self.mark("reserved")
        # NOTE: the claimed slots may have been freed while kernels queued on the compute stream
        # still read their old contents; the copy must not overwrite them before those finish.
        self.after_compute(s.h2d, s.stage_h2d)
        self.n0, self.order, self.src, self.hsrc = n0, order, src, hslots
        # By plain DMAs (host runs coalesced): no index upload and no kernel launch before the link starts.
        return c.copier(c, "h2d", c.host.words, src[:n0], c.device.words, self.claimed[:n0], mode="dma")

    def first_enqueued(self, first) -> None:
        self.first_done = first.done()

    def prepare(self, prime: int) -> None:
        # The rest of the bookkeeping runs while the first chunk crosses.
        c, ids, order = self.ctx, self.ids, self.order
        self.order_ids = list(map(ids.__getitem__, order))
        c.device.table.record_reserved(self.order_ids, self.claimed)
        self.dslots, self.claimed = self.claimed, None       # walk order
        back = [0] * len(order)                  # command position -> position in walk order
        for k, i in enumerate(order):
            back[i] = k
        self.back = back
        self.pending = self._chunks(self.src, self.dslots, self.n0, self.first_done)
        self.advance(prime)
        self.expected = c.host.checksums_of(ids)
        self.expected_walk = list(map(self.expected.__getitem__, order))

    def _chunks(self, src_slots, dst_slots, n0: int, first_done):
        c = self.ctx
        copier = c.copier(c, "h2d", c.host.words, src_slots, c.device.words, dst_slots)
        step, n = max(1, c.pipeline_blocks), len(self.ids)
        self.hasher = None
        done = first_done
        for lo in range(n0, n, step):
            hi = min(n, lo + step)
            self.nearly = done                   # the link is busy with the chunks before this one
            copier.enqueue(lo, hi)
            done = copier.done()
            if self.hasher is None:              # once the link has its second chunk
                self._start_hash(dst_slots, n0, first_done)
            self.hasher.enqueue(lo, hi, after=done)
            yield
        if self.hasher is None:
            self._start_hash(dst_slots, n0, first_done)
        self.hashed = self.hasher.done()

    def device_done(self) -> bool:
        """Every chunk enqueued, landed and hashed (the hash stream waited on each chunk)."""
        return self.pending is None and getattr(self, "hashed", None) is not None and self.hashed.query()

    def _start_hash(self, dst_slots, n0: int, first_done) -> None:
        self.hasher = Hasher(self.ctx, self.ctx.device.words, dst_slots, self.order_ids)
        self.hasher.enqueue(0, n0, after=first_done)

    def finish(self):
        c, s = self.ctx, self.ctx.streams
        self.enqueue_rest()
        ids, keep = self.ids, self.cmd.keep_source
        k = len(self.hasher.parts)
        # Both halves of the checksums head home as soon as they are hashed: the head (every
        # chunk but the last) while the last chunk crosses, the tail right after it.
        head = self.hasher.land(0, k - 1)
        tail = self.hasher.land(k - 1, k, spin=True)
        early = c.device.table.can_publish(ids) and (keep or c.host.table.can_free_all(ids))
        n_head = sum(p.numel() for p in self.hasher.parts[: k - 1]) if k > 1 else 0
        if early:
            early = head.read() == self.expected_walk[:n_head]   # sleeps while the head crosses
            self.nearly_done(len(ids) - n_head)
        self.bytes_moved = len(ids) * c.layout.block_bytes
        if not early:
            tail.read()
            self.mark("landed")
            return self._verify_then_commit(head.read() + tail.read())
        # Apply the commit while the last chunk crosses (see SpillToHost.finish); undone exactly
        # if the wait fails or the last chunk's checksums differ.
        packed = pack_checksums(self.expected)   # the ack's, ready before the bytes are
        c.device.table.publish_checked(ids)
        s.wait_event(self.compute, self.hashed)  # no compute kernel reads a page before it landed
        freed = 0
        if not keep:
            freed = c.host.table.free_all_checked(ids)
            c.host.drop_checksums(ids)
        try:
            last = tail.read()                   # spins through the last chunk
        except BaseException:
            self._unapply(freed)
            raise
        self.mark("landed")
        if last != self.expected_walk[n_head:]:
            self._unapply(freed)
            return self._mismatch(head.read() + last)
        self.dslots = None
        return self.acked(freed, packed)

    def _unapply(self, freed: int) -> None:
        c = self.ctx
        if freed:
            c.host.table.unfree_checked(self.ids, self.hsrc)
            c.host.undrop_checksums(self.ids, self.expected)
        c.device.table.unpublish_checked(self.ids)

    def _mismatch(self, walked: list[int]):
        got = list(map(walked.__getitem__, self.back))
        bad = [(b, e, g) for b, e, g in zip(self.ids, self.expected, got) if e != g]
        self.rollback()
        return self.failed(str(ChecksumMismatch("restore host->device", bad)))

    def _verify_then_commit(self, walked: list[int]):
        """The careful order: compare every checksum, then publish, then free the source."""
        c, s = self.ctx, self.ctx.streams
        if walked != self.expected_walk:
            return self._mismatch(walked)
        c.device.publish(self.ids)               # raises, naming what is wrong
        self.dslots = None
        s.wait_event(self.compute, self.hashed)
        return self.acked(self.free_source(), self.expected)
