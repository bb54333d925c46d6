"""What every move executor shares: its context, the in-flight protocol, and its outcome values.

A move runs in two halves so that moves in opposite directions overlap:

    begin()   reserve destination slots, enqueue copies and checksums on the copy streams;
              returns at once on a GPU. A route may enqueue only its first chunks here and
              leave the rest in ``pending``, one chunk per ``advance()``: the mover then
              advances every move in flight in turn (``Mover.pump``), so a spill and a restore
              submitted one after the other both reach the link within a chunk's enqueue time,
              instead of the second waiting for the whole of the first's enqueue.
    finish()  wait for this move's events, verify, then commit: publish the destination copy,
              free the source if asked, and return ``MoveAcked`` — or roll back and return
              ``MoveFailed`` naming the blocks.
    abort()   on any exception: wait for whatever this move enqueued, then drop its reservations,
              so the pools are exactly as before the move.

Commit happens only at the end of ``finish``, after every check that can fail, so a move is
all-or-nothing: no outcome ever leaves half its blocks moved.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from residency.dataplane.moves.copy import Copier
from residency.dataplane.moves.dma import RawDma, TorchDma
from residency.dataplane.moves.indexes import IndexUploader, Landed, SumsLanding
from residency.dataplane.moves.plan import MovePlan
from residency.dataplane.moves.staging import DeviceStaging, StagingRing
from residency.dataplane.moves.streams import CopyStreams
from residency.dataplane.pools import DevicePool, DiskTier, HostPool, KVLayout

log = structlog.get_logger("dataplane.moves")
from residency.events.catalog import MoveAcked, MoveFailed, pack_checksums
from residency.kernels.checksum import block_checksums


_DONE = object()
# The fewest bytes of one block a restore from disk that lands by layer reads at a time
# (moves/layered_disk.py: a band of layers; a smaller read costs a file's reopening for little)
DISK_READ_BYTES = 256 << 10


@dataclass
class MoveContext:
    worker: int
    layout: KVLayout
    device: DevicePool
    host: HostPool
    disk: DiskTier
    streams: CopyStreams
    indexes: dict[str, IndexUploader]      # "d2h", "h2d", "hash"
    landing: SumsLanding                   # where checksums come home (pinned, read by kernel stores)
    ring: StagingRing
    staging: DeviceStaging                 # device buffers of the "staged" copy mode
    copy_modes: dict[str, str]             # "d2h"/"h2d" -> "dma" | "staged" (moves/copy.py)
    pipeline_blocks: int                   # blocks per pipelined chunk (copy+hash, staging buffer)
    clock: Callable[[], int]
    # told (move_id, bytes still to cross, their estimated time in us) when a move of several
    # chunks has all but its last across (the worker sends MoveNearlyDone); None: nobody listens
    on_nearly_done: Callable[[str, int, int], None] | None = None
    # how runs of rows are copied by DMA (moves/dma.py): the CUDA runtime straight, or torch
    dma: TorchDma | RawDma = field(default_factory=TorchDma)
    # what copies a device<->host move's blocks: Copier, or a bench's variant of it
    copier: Callable[..., Copier] = Copier
    # the fewest bytes of a block a layer-by-layer restore from disk reads at a time (a band of layers)
    disk_read_bytes: int = DISK_READ_BYTES


class InFlight:
    """One move between begin and its outcome. Subclasses implement a route."""

    route: tuple[str, str]

    def __init__(self, ctx: MoveContext, plan: MovePlan, started_ns: int):
        self.ctx = ctx
        self.plan = plan
        self.cmd = plan.cmd
        self.ids = plan.blocks
        self.started_ns = started_ns
        self.compute = ctx.streams.compute_stream()
        self.bytes_moved: int | None = None     # None = not measured yet
        # Host-clock marks (perf_counter_ns) of the move's phases, for bench/moves.py:
        # submitted -> validated -> enqueued (begin done) -> landed (copies seen complete) -> settled
        self.phases: dict[str, int] = {}
        self.pending: Iterator[None] | None = None   # the rest of the enqueue, one chunk per step
        # Routes that chunk their copies keep here, as they enqueue each chunk, an event after the
        # chunks before it: once all are enqueued, after every chunk but the last (None: not yet,
        # or a route that cannot tell).
        self.nearly = None
        self.ahead = False       # begun before its command came (Mover.begin_ahead) and not yet waited for
        self.own_wait = False    # finished only by its own wait, never settled beside another (Mover.submit_own)

    def device_done(self) -> bool:
        """Whether everything this move enqueued on the device has finished, so ``finish()``
        would not wait. False where the route cannot tell without waiting (it is then finished
        when its caller waits for it). Routes with copies in flight override it."""
        return False

    def chunked(self) -> bool:
        """Whether the move copies in more than one chunk (its first, then pipelined ones)."""
        return False

    def nearing(self) -> bool:
        """Whether all but the move's last chunk are across (False without chunks to tell by)."""
        return self.nearly is not None and self.nearly.query()

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.perf_counter_ns()

    def nearly_done(self, blocks_left: int) -> None:
        """All but the last ``blocks_left`` blocks are across: tell ``ctx.on_nearly_done``, if
        anyone listens and the move had more than that one chunk (a hint; its failure is logged
        and changes nothing about the move)."""
        hook = self.ctx.on_nearly_done
        if hook is None or blocks_left >= len(self.ids):
            return
        self.mark("nearly_done")
        left = blocks_left * self.ctx.layout.block_bytes
        done = (len(self.ids) - blocks_left) * self.ctx.layout.block_bytes
        elapsed_ns = max(0, self.ctx.clock() - self.started_ns)
        try:
            hook(self.cmd.move_id, left, left * elapsed_ns // (done * 1000))
        except Exception as e:  # noqa: BLE001
            log.warning("nearly_done_hook_failed", move_id=self.cmd.move_id, error=repr(e))

    # ------------------------------------------------------------ protocol
    def begin(self) -> None:
        """Enqueue work. May raise; the mover then calls abort()."""

    def start(self) -> None:
        """The part of begin that gets the link going; ``prepare`` does the rest. Routes that can
        (device<->host) claim their slots and enqueue a first chunk here, so moves submitted
        together (``Mover.submit_many``) all reach the link before any of them does its
        bookkeeping. By default the whole of begin."""
        self.begin()

    def start_in_slices(self, slice_blocks: int, first_chunks: int = 1, lead_blocks: int = 0):
        """``start`` as a generator, one step per ``slice_blocks`` blocks of a first chunk of
        ``first_chunks`` pipeline chunks, the first step ``lead_blocks`` long when that is more
        (``Mover.submit_many`` steps the moves in turn). By default all of start in one step."""
        self.start()
        return
        yield

    def prepare(self, prime: int) -> None:
        """The rest of begin after ``start``, enqueuing at most ``prime`` more chunks."""

    def finish(self) -> MoveAcked | MoveFailed:
        raise NotImplementedError

    def advance(self, steps: int = 1) -> bool:
        """Enqueue up to ``steps`` more chunks; True while chunks are left. Raises what a chunk raises."""
        it = self.pending
        for _ in range(steps):
            if it is None:
                return False
            if next(it, _DONE) is _DONE:
                self.pending = it = None
        return it is not None

    def enqueue_rest(self) -> None:
        """Enqueue every chunk still pending (finish() starts with this)."""
        while self.advance(1 << 20):
            pass

    def abort(self) -> None:
        """Wait for this move's enqueued work, then undo its reservations. Idempotent."""
        self.pending = None          # enqueue nothing more
        self.drain()
        self.rollback()

    # Where a route keeps the destination slots it holds for its blocks, dropped by ``rollback``:
    # ``claimed`` (slots taken off the free list, not yet recorded against the blocks) and the
    # attribute named here (slots recorded as reserved: the blocks arrive there). None: a route
    # that reserves nothing on a device or host pool (the disk writers keep their own).
    reserved_slots: str | None = None

    def rollback(self) -> None:
        """Drop the destination reservations: unclaim what was claimed and not recorded, cancel
        what was recorded (the pool exactly as before the move). Idempotent."""
        if self.reserved_slots is None:
            return
        pool = self.ctx.device if self.route[1] == "device" else self.ctx.host
        if getattr(self, "claimed", None) is not None:
            pool.table.unclaim(self.claimed)
            self.claimed = None
        if getattr(self, self.reserved_slots, None) is not None:
            pool.cancel(self.ids)
            setattr(self, self.reserved_slots, None)

    def after_compute(self, *streams) -> None:
        """Order ``streams`` after the work already queued on the caller's compute stream."""
        s = self.ctx.streams
        for stream in streams:
            s.wait_stream(stream, self.compute)

    def drain(self) -> None:
        s = self.ctx.streams
        if s.cuda:
            for stream in s.all():
                stream.synchronize()

    # ------------------------------------------------------------ outcomes
    def acked(self, bytes_freed_src: int, checksums: Sequence[int] | bytes) -> MoveAcked:
        """``checksums``: the values, or already packed (``pack_checksums``, done while the last
        chunk crossed)."""
        packed = checksums if isinstance(checksums, bytes) else pack_checksums(checksums)
        return MoveAcked(
            move_id=self.cmd.move_id, worker=self.ctx.worker, bytes_moved=int(self.bytes_moved or 0),
            bytes_freed_src=int(bytes_freed_src), checksum_ok=True, started_ns=self.started_ns,
            finished_ns=self.ctx.clock(), checksums=packed,
        )

    def failed(self, error: str) -> MoveFailed:
        return MoveFailed(move_id=self.cmd.move_id, worker=self.ctx.worker, error=error,
                          bytes_moved=self.bytes_moved)

    def free_source(self) -> int:
        """Free the source copies if the command says so; returns bytes the source pool freed."""
        if self.cmd.keep_source:
            return 0
        src = {"device": self.ctx.device, "host": self.ctx.host, "disk": self.ctx.disk}[self.cmd.src]
        return src.free(self.ids)


class Hasher:
    """psum64 of some rows of a table, enqueued on the hash stream in chunks; indices uploaded once."""

    def __init__(self, ctx: MoveContext, words: torch.Tensor, slots: Sequence[int], ids: Sequence[int]):
        self.ctx = ctx
        self.words = words
        self.slots, self.block_ids = ctx.indexes["hash"].upload(ctx.streams.hash, slots, ids)
        self.parts: list[torch.Tensor] = []
        self.marks: list = []                 # per part: the hash stream after it

    def enqueue(self, lo: int, hi: int, after=None) -> None:
        s = self.ctx.streams
        if after is not None:
            s.wait_event(s.hash, after)
        with s.on(s.hash):
            self.parts.append(block_checksums(self.words, self.slots[lo:hi], self.block_ids[lo:hi]))
        self.last = s.mark(s.hash)          # after this hasher's own work, not later moves' on the stream
        self.marks.append(self.last)

    def done(self, spin: bool = False):
        """The event after all enqueued hashing (and whatever the hash stream waited on)."""
        return self.ctx.streams.mark(self.ctx.streams.hash, spin)

    def land(self, lo: int = 0, hi: int | None = None, spin: bool = False) -> Landed:
        """Bring parts [lo, hi) home (after their hashing), into the landing row at their own
        offset, so a head and a tail of one move can be in flight at once; ``.read()`` waits."""
        parts = self.parts[lo:hi]
        if not parts:
            return Landed([], None, None)
        at = sum(p.numel() for p in self.parts[:lo])
        s = self.ctx.streams
        s.wait_event(s.small, self.marks[len(self.parts[:hi]) - 1])
        with s.on(s.small):
            sums = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.ctx.landing.land(sums, at, spin=spin)

    def values(self) -> list[int]:
        """The checksums as ints (waits for the hashing)."""
        return self.land().read()
