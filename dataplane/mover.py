"""Mover: the moves of one data-plane worker's blocks between its tiers, in-process.

    cmd ─► validate ─► MoveRejected (nothing changed)
              │
              └─► executor.begin()  reserve dst, enqueue the first copies + checksums on the copy
                                    streams (the rest: one chunk per pump(), interleaved with
                                    the other moves in flight)
                  executor.finish() wait, verify, commit (publish dst, free src) ─► MoveAcked
                                    or roll back (pools unchanged)                ─► MoveFailed

Every outcome is recorded by move_id; a duplicate command is answered with the recorded outcome
and never moves anything again. ``submit``/``wait`` split a move so that a spill and a restore
(or any moves in opposite directions) run at once; ``submit_many`` starts several so that each
reaches the link before any does the rest of its bookkeeping; ``execute`` is submit+wait.
``begin_ahead``/``abandon`` begin a move before its command comes and undo it when the command
does not come (an early start: nothing recorded or visible meanwhile).

Its parts: ``Tiers`` (dataplane/tiers.py) owns the pools and every pinned buffer; ``BlockOps``
(dataplane/block_ops.py) makes and drops blocks outside a move; the executors (dataplane/moves/)
run one route each. The ZMQ process shell that receives commands and sends the replies is
another module; it calls this class from one thread.
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat

import structlog
import torch

from residency.dataplane.block_ops import BlockOps, seeded_words
from residency.dataplane.moves import EXECUTORS, PRIME_CHUNKS, Copier, DeviceStaging, InFlight, MoveContext, validate
from residency.dataplane.moves.dma import RawDma, TorchDma, dma_issuer
from residency.dataplane.moves.layered import LandsByLayer, RestoreByLayer
from residency.dataplane.moves.layered_disk import RestoreFromDiskByLayer
from residency.dataplane.moves.record import MoveRecord, Outcome
from residency.dataplane.pools import DataPlaneError, IntegrityError, KVLayout, TornPool
from residency.dataplane.rebind import attach_mover_readers
from residency.dataplane.tiers import TIERS, Tiers
from residency.dataplane.warm_up import warm_up
from residency.events.catalog import MoveRejected
from residency.events.commands import BlocksReleased, BlocksWritten, CommitBlocks, ExecuteMove, MovesReport, ReleaseBlocks

log = structlog.get_logger("dataplane.mover")


def copy_modes_for(dma: TorchDma | RawDma) -> dict[str, str]:
    """How the chunks after a move's first cross, per direction, given the DMA issuer: "dma"
    (one DMA per run of blocks) where the runtime issues a call's DMAs in one batch
    (cudaMemcpyBatchAsync); "staged" (gathered into a device buffer, then long DMAs) where each
    DMA is its own call, as on the CPU path. Batched, plain DMAs match staged copies one way,
    beat them both ways at once and leave the SMs to the model; issued one by one, the gaps
    between a move's scattered DMAs keep the link idle, and staged copies win."""
    mode = "dma" if dma.batched else "staged"
    return {"d2h": mode, "h2d": mode}


# How often Mover.wait looks for other moves in flight whose bytes have landed, to settle them
# while the awaited move still crosses (only when there are such moves; a few µs a look).
SETTLE_POLL_S = 0.0002

# Moves submitted together start their links in turn by slices of this many blocks of their first
# chunks (8 blocks of 2 MiB: ~0.3 ms on the link, ~0.08 ms of DMA enqueues each).
FIRST_SLICE_BLOCKS = 8
# ...and first chunks this many pipeline chunks long: each link stays busy while the mover's
# thread does both moves' bookkeeping (with one-chunk first chunks the restore's link sat idle
# while the spill's bookkeeping ran).
FIRST_CHUNKS_TOGETHER = 2
# ...and the first move's first step this long (64 MiB): its link stays busy while the next move
# is admitted (~0.9 ms for a 1024-block restore; with an 8-block step the spill's link idled
# through the restore's admission and the spill finished last).
FIRST_LEAD_BLOCKS = 32
_STARTED = object()

# Routes a move may begin before its command comes: their copies only fill slots they reserve;
# the disk routes write files, so they wait for their command.
AHEAD_ROUTES = {("device", "host"), ("host", "device")}

# A serving worker's restores (``layered_restores``): from the host or from disk, layer by layer
LAYERED: dict[tuple[str, str], type[InFlight]] = {cls.route: cls for cls in (RestoreByLayer, RestoreFromDiskByLayer)}


@dataclass(frozen=True)
class MoveTicket:
    move_id: str


class Mover:
    def __init__(
        self,
        layout: KVLayout,
        device_blocks: int,
        host_bytes: int,
        disk_dir: str | os.PathLike,
        pinned_budget_bytes: int,
        device: str = "cpu",
        *,
        worker: int = 0,
        disk_bytes: int | None = None,
        pipeline_blocks: int = 64,
        fsync: bool = True,
        clock: Callable[[], int] = time.time_ns,
        dma: TorchDma | RawDma | None = None,
        copier: Callable[..., Copier] = Copier,
        layered_restores: bool = False,
    ):
        """``pipeline_blocks``: blocks per pipelined chunk of a device<->host move. ``dma``: how
        runs of rows are copied (None: the runtime's own, ``dma_issuer``); the copy mode follows
        from it (``copy_modes_for``). ``copier``: what copies a device<->host move's blocks (the
        benches pass their own variants to compare against it). ``layered_restores``: restores from
        the host or from disk land layer by layer (``RestoreByLayer``, ``RestoreFromDiskByLayer``),
        so a prefill can read each layer as it lands (a serving worker's; see ``landing``)."""
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DataPlaneError(f"device {device!r} asked for, but this host has no CUDA device")
        self.log = log.bind(worker=worker)
        if dma is None:
            dma = dma_issuer(dev)
            refused = getattr(dma, "batch_refused", None)
            if refused is not None:
                self.log.warning("dma_batch_unavailable", why=refused, issuing="one cudaMemcpyAsync per run")
        self.tiers = Tiers(layout, device_blocks, host_bytes, disk_dir, pinned_budget_bytes, dev,
                           disk_bytes=disk_bytes, fsync=fsync)
        self.layout = layout
        self.worker = worker
        self.torch_device = dev
        self.clock = clock
        t = self.tiers
        # the parts the model runner, the process shell and the tests read
        self.pinned, self.streams, self.disk_report = t.pinned, t.streams, t.disk_report
        self.device_pool, self.host_pool, self.disk_tier = t.device_pool, t.host_pool, t.disk_tier
        self.ctx = MoveContext(
            worker=worker, layout=layout, device=t.device_pool, host=t.host_pool, disk=t.disk_tier,
            streams=t.streams, indexes=t.indexes, landing=t.landing, ring=t.ring,
            staging=DeviceStaging(layout, pipeline_blocks, dev), copy_modes=copy_modes_for(dma),
            pipeline_blocks=pipeline_blocks, clock=clock, dma=dma, copier=copier,
        )
        self.layered_restores = layered_restores
        self.record = MoveRecord(worker, self.log)
        self._inflight: dict[str, InFlight] = {}
        self._busy: dict[int, str] = {}
        self.blocks = BlockOps(t, self._busy, worker)
        attach_mover_readers(self)           # the pool's "mover" and "staging" readers (dataplane/rebind.py)
        self.last_phases: dict[str, int] = {}   # host-clock phase marks of the last settled move
        # called with a move's outcome as soon as ``wait`` has it, before the mover's own
        # bookkeeping (unregistering the move, recording the outcome); must not raise
        self.on_outcome: Callable[[Outcome], None] | None = None

    pinned_bytes_needed = staticmethod(Tiers.pinned_bytes_needed)

    # ------------------------------------------------------------ tiers and blocks
    def pool(self, tier: str):
        return self.tiers.pool(tier)

    def capacities(self) -> dict[str, int]:
        return self.tiers.capacities()

    def usage(self) -> dict[str, int]:
        """Bytes taken on each tier, including slots reserved by moves in flight."""
        return self.tiers.usage()

    def commit_blocks(self, cmd: CommitBlocks) -> BlocksWritten:
        return self.blocks.commit_blocks(cmd)

    def adopt_blocks(self, request_id: str, block_ids: list[int], keys: list[str] | None = None) -> BlocksWritten:
        return self.blocks.adopt_blocks(request_id, block_ids, keys)

    def release(self, cmd: ReleaseBlocks) -> BlocksReleased:
        return self.blocks.release(cmd)

    def warm_up(self) -> dict:
        """Run the move paths once on scratch blocks before any command (``warm_up.warm_up``)."""
        return warm_up(self)

    # ------------------------------------------------------------ moves
    def execute(self, cmd: ExecuteMove) -> Outcome:
        return self.wait(self.submit(cmd))

    def submit(self, cmd: ExecuteMove) -> MoveTicket:
        """Validate and begin a move; its copies run while the caller does other work."""
        mv = self._admit(cmd)
        if mv is not None:
            try:
                mv.begin()
                mv.mark("enqueued")
            except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
                self._fail(mv, e)
        return MoveTicket(cmd.move_id)

    def submit_own(self, cmd: ExecuteMove) -> MoveTicket:
        """``submit``, for a move only its own ``wait`` may finish (never settled beside another
        move's): its caller finishes it when it chooses (dataplane/restore_pipeline.py)."""
        ticket = self.submit(cmd)
        mv = self._inflight.get(cmd.move_id)
        if mv is not None:
            mv.own_wait = True
        return ticket

    def submit_many(self, cmds: Iterable[ExecuteMove]) -> list[MoveTicket]:
        """Begin moves meant to run together (a spill and a restore): every move reaches the link
        (validated, slots claimed, first chunk enqueued) before any does the rest of its begin,
        and the first chunks go in turn, ``FIRST_SLICE_BLOCKS`` blocks of each, so the second
        direction starts right after the first's first slice instead of after its whole first
        chunk. Each is validated against the ones before it, as by ``submit``."""
        cmds = list(cmds)
        starting, started = [], []
        for cmd in cmds:                 # each claims its slots and gives its link a first slice...
            mv = self._admit(cmd)
            if mv is None:
                continue
            lead = FIRST_LEAD_BLOCKS if len(cmds) > 1 and not started else 0    # ...the first a longer one
            steps = mv.start_in_slices(FIRST_SLICE_BLOCKS, FIRST_CHUNKS_TOGETHER if len(cmds) > 1 else 1, lead)
            starting.append((mv, steps))
            started.append(mv)
            if not self._step_start(mv, steps):
                starting.pop()
        while starting:                  # ...then the rest of the first chunks, a slice of each in turn
            starting = [(mv, steps) for mv, steps in starting if self._step_start(mv, steps)]
        started = [mv for mv in started if mv.cmd.move_id in self._inflight]     # not failed starting
        for mv in started:
            try:
                mv.prepare(0)
                mv.mark("enqueued")
            except Exception as e:  # noqa: BLE001
                self._fail(mv, e)
        for _ in range(PRIME_CHUNKS):                # as many chunks queued as submit's begin queues
            self.pump()
        return [MoveTicket(cmd.move_id) for cmd in cmds]

    def _step_start(self, mv: InFlight, steps) -> bool:
        """One step of a move's start; False when it is done starting, or failed (recorded, and
        no longer in flight)."""
        try:
            return next(steps, _STARTED) is not _STARTED
        except Exception as e:  # noqa: BLE001
            self._fail(mv, e)
            return False

    def _admit(self, cmd: ExecuteMove, record: bool = True) -> InFlight | None:
        """The move in flight for ``cmd``, registered; None if it is a duplicate or refused (recorded,
        unless ``record`` is False: an early start's refusal is the command's to answer)."""
        t0 = time.perf_counter_ns()
        if cmd.move_id in self.record or cmd.move_id in self._inflight:
            if record:
                self.log.info("move_duplicate", move_id=cmd.move_id)
            return None
        tiers = {t: self.pool(t) for t in TIERS}
        torn = self._torn(cmd)
        if torn is not None:
            if record:
                self.record.add(torn)
            return None
        plan = validate(cmd, tiers, self._busy, self.layout.block_bytes, self.worker, self.clock())
        if isinstance(plan, MoveRejected):
            if record:
                self.record.add(plan)
            return None
        executor = (LAYERED.get(plan.route) if self.layered_restores else None) or EXECUTORS[plan.route]
        mv = executor(self.ctx, plan, self.clock())
        mv.phases["submitted"] = t0
        mv.mark("validated")
        self._busy.update(dict.fromkeys(plan.blocks, cmd.move_id))
        self._inflight[cmd.move_id] = mv
        return mv

    def _torn(self, cmd: ExecuteMove) -> MoveRejected | None:
        """The refusal of a move to or from a torn device pool (a reader behind its generation)."""
        if "device" not in (cmd.src, cmd.dst):
            return None
        try:
            self.device_pool.check_usable("the mover")
        except TornPool as e:
            self.log.warning("move_on_torn_pool", move_id=cmd.move_id, behind=e.behind, gen=e.gen)
            return MoveRejected(move_id=cmd.move_id, worker=self.worker, reason=str(e),
                                asked_bytes=len(cmd.blocks) * self.layout.block_bytes, blocks=list(cmd.blocks))
        return None

    @property
    def num_inflight(self) -> int:
        """Moves begun and not yet settled (an early start included)."""
        return len(self._inflight)

    def wait(self, ticket: MoveTicket | str) -> Outcome:
        """The move's outcome, waiting for its copies if it is in flight."""
        move_id = ticket.move_id if isinstance(ticket, MoveTicket) else ticket
        if move_id in self.record:
            return self.record.get(move_id)
        mv = self._inflight.get(move_id)
        if mv is None:
            raise DataPlaneError(f"unknown move {move_id!r}: never submitted to this worker")
        mv.ahead = False                      # an early start's command came: it is this call's now
        while mv.pending is not None and move_id in self._inflight:
            self.pump()                       # this move's chunks, interleaved with the others'
        if move_id in self.record:            # a chunk raised: the move already failed
            return self.record.get(move_id)
        self._settle_landed_beside(mv)
        return self._finish(mv)

    def _finish(self, mv: InFlight) -> Outcome:
        try:
            outcome = mv.finish()
        except Exception as e:  # noqa: BLE001
            return self._fail(mv, e)
        if self.on_outcome is not None:      # e.g. the shell sends it while the mover settles
            self.on_outcome(outcome)
        return self._settle(mv, outcome)

    def _settle_landed_beside(self, target: InFlight) -> None:
        """While ``target``'s chunks cross, settle the other moves in flight as their bytes land.

        A spill and a restore submitted together end a few ms apart; finished one after the
        other once both have landed, the host work of the first (its checksums home, the tables,
        the ack: ~1.7 ms for a 1024-block spill) would run after the second's last byte. Here
        the mover's thread looks every ``SETTLE_POLL_S`` until ``target`` is on its last chunk,
        and settles each other move whose device work is over (``InFlight.device_done``) at
        once. Only for a target of several chunks (``InFlight.chunked``): a move of one is not
        kept waiting behind another's bookkeeping."""
        if not target.chunked():
            return
        while True:
            others = [m for m in self._inflight.values()
                      if m is not target and m.pending is None and not m.ahead and not m.own_wait]
            if not others:
                return
            try:                              # an event that cannot be queried: each move's own
                landed = [m for m in others if m.device_done()]            # wait will say why
                if not landed and (target.nearing() or target.device_done()):
                    return
            except Exception as e:  # noqa: BLE001
                self.log.warning("settle_beside_stopped", move_id=target.cmd.move_id, error=repr(e))
                return
            for m in landed:
                self._finish(m)
            if not landed:
                time.sleep(SETTLE_POLL_S)

    def pump(self) -> bool:
        """Enqueue one more chunk of every move in flight that has chunks left, in turn.

        Moves submitted together then share the streams from their first chunks on: a restore
        submitted right after a spill does not wait for the spill's whole enqueue. Returns
        whether any chunk is left. A chunk that raises fails its move (recorded, pools unchanged).
        """
        left = False
        for mv in [m for m in self._inflight.values() if m.pending is not None]:
            try:
                left |= mv.advance(1)
            except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
                self._fail(mv, e)
        return left

    def landing(self, move_id: str) -> tuple[list, dict[int, int]] | None:
        """A layer-by-layer restore in flight: (per layer, the wait for it; block -> the slot it
        lands in). None: not in flight here, or not landing by layer. Its blocks are not
        published: whoever reads them before ``wait`` returns an ack must not let anything
        computed from them out unless it does (dataplane/restore_pipeline.py)."""
        mv = self._inflight.get(move_id)
        if not isinstance(mv, LandsByLayer):
            return None
        return mv.landing()

    def device_done(self, move_id: str) -> bool:
        """Whether the move's copies (and checksums) are done, so ``wait`` would not block on them
        (False for a move not in flight, or whose route cannot tell)."""
        mv = self._inflight.get(move_id)
        if mv is None:
            return False
        try:
            return mv.pending is None and mv.device_done()
        except Exception:  # noqa: BLE001 - its wait will say why
            return True

    def outcome_of(self, move_id: str) -> Outcome | None:
        """The recorded outcome, or None if unknown here or still in flight."""
        return self.record.get(move_id)

    def report(self, move_ids: Iterable[str]) -> MovesReport:
        """Answer a QueryMoves after a control restart."""
        return self.record.report(move_ids, self._inflight)

    def _fail(self, mv: InFlight, e: Exception) -> Outcome:
        self._undo(mv, "move_raised", repr(e), self.log.error)
        return self._settle(mv, mv.failed(f"{type(e).__name__}: {e}"))

    def _undo(self, mv: InFlight, what: str, why: str, say=None) -> None:
        """Abort ``mv`` (wait for what it enqueued, drop its reservations) and log ``what``."""
        try:
            mv.abort()
        except Exception as e:  # noqa: BLE001
            self.log.error("move_abort_failed", move_id=mv.cmd.move_id, error=repr(e))
        (say or self.log.info)(what, move_id=mv.cmd.move_id, why=why)

    def _settle(self, mv: InFlight, outcome: Outcome) -> Outcome:
        mv.mark("settled")
        self.last_phases = dict(mv.phases)
        self._unregister(mv)
        return self.record.add(outcome)

    def _unregister(self, mv: InFlight) -> None:
        """No longer in flight, its blocks no longer busy."""
        self._inflight.pop(mv.cmd.move_id, None)
        # Validation kept other moves' blocks out of this one, so every listed block is ours.
        deque(map(self._busy.pop, mv.ids, repeat(None, len(mv.ids))), maxlen=0)

    # ------------------------------------------------------------ early start
    def keep_own(self, move_id: str) -> None:
        """A move in flight (an early start whose command came) is finished only by its own ``wait``."""
        mv = self._inflight.get(move_id)
        if mv is not None:
            mv.own_wait = True

    def begin_ahead(self, cmd: ExecuteMove) -> bool:
        """Begin a device <-> host move whose command has not come yet (an early start: its
        CommandAhead came first, riding on the control's commit of ``MoveRequested``). Admitted
        as ``submit`` admits it, but a refusal, or a failure to begin, is not recorded: it
        returns False, and the command, when it comes, runs and is answered as any. Until
        ``wait`` finishes it, the move is only reserved slots and bytes in flight that nothing
        else can see; ``abandon`` undoes it exactly. True: begun."""
        if (cmd.src, cmd.dst) not in AHEAD_ROUTES:
            return False
        mv = self._admit(cmd, record=False)
        if mv is None:
            return False
        try:
            mv.begin()
        except Exception as e:  # noqa: BLE001 - the command runs as any when it comes
            self._unregister(mv)
            self._undo(mv, "begin_ahead_failed", repr(e))
            return False
        mv.mark("enqueued")
        mv.ahead = True                 # not settled beside another move: only its own wait finishes it
        return True

    def abandon(self, move_id: str, why: str) -> None:
        """Undo an early-started move whose command did not come (``begin_ahead``): wait for what
        it enqueued, drop its reservations (the pools exactly as before), record nothing."""
        mv = self._inflight.get(move_id)
        if mv is None:
            return
        self._unregister(mv)
        self._undo(mv, "move_abandoned", why, self.log.warning)

    # ------------------------------------------------------------ invariants, teardown
    def check_integrity(self) -> None:
        """Raise IntegrityError with the numbers if any invariant of the worker's memory is broken."""
        self.tiers.check_integrity()
        in_moves = {b: m for m, mv in self._inflight.items() for b in mv.ids}
        if in_moves != self._busy:
            raise IntegrityError(f"busy map ({len(self._busy)} blocks) != blocks of {len(self._inflight)} "
                                 f"moves in flight ({len(in_moves)} blocks)")
        for tier, reserved in (("device", self.device_pool.table.reserved_blocks()),
                               ("host", self.host_pool.table.reserved_blocks())):
            owned = {b for mv in self._inflight.values() if mv.cmd.dst == tier for b in mv.ids}
            leaked = sorted(set(reserved) - owned)
            if leaked:
                raise IntegrityError(f"{tier}: {len(leaked)} reserved slots belong to no move in flight: {leaked[:16]}")
        self.record.check_integrity(self._inflight)

    def close(self) -> None:
        """Finish moves in flight, then unpin and release every pinned buffer."""
        for move_id in list(self._inflight):
            self.wait(move_id)
        self.tiers.close()

    def __enter__(self) -> Mover:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Mover", "MoveTicket", "copy_modes_for", "seeded_words"]
