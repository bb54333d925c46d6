"""Engine: the memory of one data-plane worker and the moves between its tiers, in-process.

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
``begin_ahead``/``abandon`` (dataplane/engine_ahead.py) begin a move before its command comes and
undo it when the command does not come (an early start: nothing recorded or visible meanwhile).
``commit_blocks``/``adopt_blocks``/``release`` (dataplane/engine_blocks.py) make and drop blocks
outside a move.

The ZMQ process shell that receives commands and sends these replies is another module; it
calls this class from one thread.
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

from residency.dataplane.moves import (
    COPY_MODES,
    EXECUTORS,
    CopyStreams,
    DeviceStaging,
    PRIME_CHUNKS,
    InFlight,
    IndexUploader,
    MoveContext,
    SumsLanding,
    StagingRing,
    validate,
)
from residency.dataplane.pools import (
    DataPlaneError,
    DevicePool,
    DiskTier,
    HostPool,
    IntegrityError,
    KVLayout,
    PinnedBudget,
)
from residency.dataplane.engine_ahead import EarlyStart
from residency.dataplane.engine_blocks import BlockOps, seeded_words
from residency.dataplane.moves.dma import dma_issuer
from residency.dataplane.pools.budget import page_round
from residency.events.catalog import MoveAcked, MoveFailed, MoveRejected
from residency.events.commands import CommitBlocks, ExecuteMove, MovesReport
from residency.kernels.checksum import block_checksums, checksums_to_ints

Outcome = MoveAcked | MoveFailed | MoveRejected
log = structlog.get_logger("dataplane.engine")

# The copy mode per direction when the caller names none: "dma" where the runtime's DMAs go in
# batches (cudaMemcpyBatchAsync), "staged" where they go one cudaMemcpyAsync per run or through
# torch (the CPU path). On the H200 hosts with batches (runs 25-26 and the three of 2026-12-05)
# "dma" matched "staged" one way (spill 53.2-53.9 vs 53.3-53.9 GB/s, restore 50.7-52.8 vs
# 50.8-52.7) and beat it both at once in every run (1.709/1.782/1.792/1.756/1.725x per round
# against 1.690/1.777/1.792/1.738/1.690x), and it leaves the SMs to the model. Without batches
# "dma" lost: 1024 scattered DMAs issued one by one kept the link idle (copy path both ways 68-89
# GB/s against staged's 74-98 in runs 4-24), and the first default (moves-2026-12-02-h200.json:
# staged 87.5%/85.1% of the link against dma 84.1%/81.4%) was measured there.
BATCHED_COPY_MODES = {"d2h": "dma", "h2d": "dma"}
UNBATCHED_COPY_MODES = {"d2h": "staged", "h2d": "staged"}


def default_copy_modes(dma) -> dict[str, str]:
    """The copy modes an Engine uses, per direction, with the DMA issuer ``dma`` it has."""
    return dict(BATCHED_COPY_MODES if dma.batched else UNBATCHED_COPY_MODES)


# Streams per direction the "dma" copy mode spreads a move's chunks over (CopyStreams.lanes).
# One: on an H100 host (bench/results/moves-lanes-2026-12-05-h100.json) the bare scattered 2 MiB
# DMAs reached 0.991 of one contiguous copy both ways with one stream, 0.984 with two; the engine
# both at once 0.956 of the bare copy with one lane, 0.929 with two, 0.928 with four.
DMA_LANES = 1

# How often Engine.wait looks for other moves in flight whose bytes have landed, to settle them
# while the awaited move still crosses (only when there are such moves; a few µs a look).
SETTLE_POLL_S = 0.0002

# Moves submitted together start their links in turn by slices of this many blocks of their first
# chunks (8 blocks of 2 MiB: ~0.3 ms on the link, ~0.08 ms of DMA enqueues each).
FIRST_SLICE_BLOCKS = 8
# ...and first chunks this many pipeline chunks long: each link stays busy while the engine thread
# does both moves' bookkeeping (a one-chunk first chunk left the restore's link idle ~1.6 ms in a
# trace on the H200: bench/results/moves-trace-2026-12-04-h200-run2.json, both_many).
FIRST_CHUNKS_TOGETHER = 2
# ...and the first move's first step this long (64 MiB): its link stays busy while the next move
# is admitted (~0.9 ms for a 1024-block restore on an H200; an 8-block step left the spill's link
# a 783 µs gap and the spill last to finish: moves-trace-2026-12-04-h200-run3.json). Not yet measured.
FIRST_LEAD_BLOCKS = 32
_STARTED = object()


@dataclass(frozen=True)
class MoveTicket:
    move_id: str


class Engine(EarlyStart, BlockOps):
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
        copy_modes: dict[str, str] | None = None,
        staging_blocks: int = 4,
        pipeline_blocks: int = 64,
        fsync: bool = True,
        verify_disk: bool = True,
        clock: Callable[[], int] = time.time_ns,
        raw_dma: bool = True,
        batch_dma: bool = True,
        dma_lanes: int = DMA_LANES,
        settle_beside: bool = True,
    ):
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise DataPlaneError(f"device {device!r} asked for, but this host has no CUDA device")
        self.layout = layout
        self.worker = worker
        self.torch_device = dev
        self.clock = clock
        dma = dma_issuer(dev, raw_dma, batch_dma)
        modes = dict(default_copy_modes(dma), **(copy_modes or {}))
        bad = {k: v for k, v in modes.items() if k not in ("d2h", "h2d") or v not in COPY_MODES}
        if bad:
            raise DataPlaneError(f"copy_modes {bad} not understood (d2h/h2d -> one of {COPY_MODES})")
        # NOTE: the pinned budget is the only way pinned memory is made in this process; every
        # buffer below registers before it allocates, and a refusal raises with its arithmetic.
        self.pinned = PinnedBudget(pinned_budget_bytes, pin=dev.type == "cuda")
        self._closers: list = []
        try:
            self.device_pool = DevicePool(layout, device_blocks, dev)
            self.host_pool = HostPool(layout, host_bytes, self.pinned)
            self._closers.append(self.host_pool)
            self.streams = CopyStreams(dev, lanes=dma_lanes)
            max_blocks = max(device_blocks, self.host_pool.num_slots, 1)
            self.indexes = {}
            for d in ("d2h", "h2d", "hash"):
                self.indexes[d] = IndexUploader(self.pinned, f"index-{d}", 2 * max_blocks, self.streams)
                self._closers.append(self.indexes[d])
            self.ring = StagingRing(self.pinned, layout, staging_blocks, self.streams)
            self._closers.append(self.ring)
            self.landing = SumsLanding(self.pinned, max_blocks, self.streams)
            self._closers.append(self.landing)
        except BaseException:
            self.close()
            raise
        self.disk_tier = DiskTier(disk_dir, layout, disk_bytes, fsync=fsync)
        self.disk_report = self.disk_tier.rebuild(verify=self._hash_disk_payload if verify_disk else None)
        self.ctx = MoveContext(
            worker=worker, layout=layout, device=self.device_pool, host=self.host_pool, disk=self.disk_tier,
            streams=self.streams, indexes=self.indexes, landing=self.landing, ring=self.ring,
            staging=DeviceStaging(layout, pipeline_blocks, dev), copy_modes=modes,
            pipeline_blocks=pipeline_blocks, clock=clock, dma=dma,
        )
        self._outcomes: dict[str, Outcome] = {}
        self._inflight: dict[str, InFlight] = {}
        self._busy: dict[int, str] = {}
        self.last_phases: dict[str, int] = {}   # host-clock phase marks of the last settled move
        # called with a move's outcome as soon as ``wait`` has it, before the engine's own
        # bookkeeping (unregistering the move, recording the outcome); must not raise
        self.on_outcome: Callable[[Outcome], None] | None = None
        # settle other moves in flight as they land while waiting for one (_settle_landed_beside)
        self.settle_beside = settle_beside
        self.log = log.bind(worker=worker)
        refused = getattr(self.ctx.dma, "batch_refused", None)
        if refused is not None and batch_dma:
            self.log.warning("dma_batch_unavailable", why=refused, issuing="one cudaMemcpyAsync per run")

    @staticmethod
    def pinned_bytes_needed(layout: KVLayout, device_blocks: int, host_bytes: int, staging_blocks: int = 4) -> int:
        """The pinned budget an Engine with these arguments registers (host pool, ring, index scratch)."""
        host_slots = host_bytes // layout.block_bytes
        max_blocks = max(device_blocks, host_slots, 1)
        return (page_round(max(host_slots * layout.block_bytes, 1))
                + page_round(staging_blocks * layout.block_bytes)
                + 3 * page_round(2 * 2 * max_blocks * 8)
                + page_round(max_blocks * 8))

    # ------------------------------------------------------------ tiers
    def pool(self, tier: str):
        return {"device": self.device_pool, "host": self.host_pool, "disk": self.disk_tier}[tier]

    def capacities(self) -> dict[str, int]:
        return {t: self.pool(t).capacity_bytes for t in ("device", "host", "disk")}

    def usage(self) -> dict[str, int]:
        """Bytes taken on each tier, including slots reserved by moves in flight."""
        return {t: self.pool(t).used_bytes for t in ("device", "host", "disk")}

    # ------------------------------------------------------------ warm-up
    WARM_UP_IDS_FROM = 1 << 62          # block ids no caller uses: [2^62, 2^62 + n)

    def warm_up(self) -> dict:
        """Run the move paths once on scratch blocks before any command: a 1-block spill and
        restore (the first chunk alone) and, room allowing, one a pipeline chunk longer than the
        first (every chunked kernel), then free them. On a GPU the first move of a process
        otherwise compiles (or loads) its Triton kernels: 0.1-0.54 s measured on the H200 on the
        first 1-block spill. Leaves no block, slot, reservation or checksum behind (the outcomes
        of its moves stay in the engine's memory under ``warm-up-*`` ids, never reported).
        Returns what it did and how long it took."""
        t0 = time.perf_counter()
        room = min(self.device_pool.table.num_free, self.host_pool.table.num_free)
        sizes = [n for n in (1, self.ctx.pipeline_blocks + 1) if n <= room]
        for k, n in enumerate(sizes):
            ids = list(range(self.WARM_UP_IDS_FROM, self.WARM_UP_IDS_FROM + n))
            self.commit_blocks(CommitBlocks(request_id=f"warm-up-{k}", session=None, tier="device", blocks=ids,
                                            seed=k))
            try:
                for step, (kind, src, dst) in enumerate((("evict", "device", "host"), ("restore", "host", "device"))):
                    out = self.execute(ExecuteMove(move_id=f"warm-up-{k}-{step}", kind=kind, src=src, dst=dst,
                                                   blocks=ids, keep_source=False,
                                                   deadline_ns=self.clock() + 600 * 10**9))
                    if not isinstance(out, MoveAcked):
                        raise DataPlaneError(f"warm-up {kind} of {n} blocks: {out}")
            finally:
                for tier in ("device", "host"):
                    held = [b for b in ids if self.pool(tier).holds(b)]
                    if held:
                        self.pool(tier).free(held)
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
        return {"blocks": sizes, "seconds": time.perf_counter() - t0}

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
        if cmd.move_id in self._outcomes or cmd.move_id in self._inflight:
            if record:
                self.log.info("move_duplicate", move_id=cmd.move_id)
            return None
        tiers = {t: self.pool(t) for t in ("device", "host", "disk")}
        plan = validate(cmd, tiers, self._busy, self.layout.block_bytes, self.worker, self.clock())
        if isinstance(plan, MoveRejected):
            if record:
                self._record(plan)
            return None
        mv = EXECUTORS[plan.route](self.ctx, plan, self.clock())
        mv.phases["submitted"] = t0
        mv.mark("validated")
        self._busy.update(dict.fromkeys(plan.blocks, cmd.move_id))
        self._inflight[cmd.move_id] = mv
        return mv

    def wait(self, ticket: MoveTicket | str) -> Outcome:
        """The move's outcome, waiting for its copies if it is in flight."""
        move_id = ticket.move_id if isinstance(ticket, MoveTicket) else ticket
        if move_id in self._outcomes:
            return self._outcomes[move_id]
        mv = self._inflight.get(move_id)
        if mv is None:
            raise DataPlaneError(f"unknown move {move_id!r}: never submitted to this worker")
        mv.ahead = False                      # an early start's command came: it is this call's now
        while mv.pending is not None and move_id in self._inflight:
            self.pump()                       # this move's chunks, interleaved with the others'
        if move_id in self._outcomes:         # a chunk raised: the move already failed
            return self._outcomes[move_id]
        self._settle_landed_beside(mv)
        return self._finish(mv)

    def _finish(self, mv: InFlight) -> Outcome:
        try:
            outcome = mv.finish()
        except Exception as e:  # noqa: BLE001
            return self._fail(mv, e)
        if self.on_outcome is not None:      # e.g. the lane sends it while the engine settles
            self.on_outcome(outcome)
        return self._settle(mv, outcome)

    def _settle_landed_beside(self, target: InFlight) -> None:
        """While ``target``'s chunks cross, settle the other moves in flight as their bytes land.

        A spill and a restore submitted together end a few ms apart; finished one after the
        other once both have landed, the host work of the first (~1.7 ms for a 1024-block spill
        on an H100 host: its checksums home, the tables, the ack) ran after the second's last
        byte (bench/moves_trace.py --tail-ms). Here the engine thread looks every
        ``SETTLE_POLL_S`` until ``target`` is on its last chunk, and settles each other move whose
        device work is over (``InFlight.device_done``) at once. Only for a target of several
        chunks (``InFlight.chunked``): a move of one is not kept waiting behind another's bookkeeping."""
        if not self.settle_beside or not target.chunked():
            return
        while True:
            others = [m for m in self._inflight.values() if m is not target and m.pending is None and not m.ahead]
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

    def outcome_of(self, move_id: str) -> Outcome | None:
        """The recorded outcome, or None if unknown here or still in flight."""
        return self._outcomes.get(move_id)

    def report(self, move_ids: Iterable[str]) -> MovesReport:
        """Answer a QueryMoves after a control restart."""
        ids = list(move_ids)
        return MovesReport(worker=self.worker, outcomes=[self._outcomes[m] for m in ids if m in self._outcomes],
                           unknown=[m for m in ids if m not in self._outcomes and m not in self._inflight])

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
        return self._record(outcome)

    def _unregister(self, mv: InFlight) -> None:
        """No longer in flight, its blocks no longer busy."""
        self._inflight.pop(mv.cmd.move_id, None)
        # Validation kept other moves' blocks out of this one, so every listed block is ours.
        deque(map(self._busy.pop, mv.ids, repeat(None, len(mv.ids))), maxlen=0)

    def _record(self, outcome: Outcome) -> Outcome:
        self._outcomes[outcome.move_id] = outcome
        # NOTE: the ledger records every outcome; the engine logs an ack at debug level only
        # (a rendered log line costs ~0.1 ms, a few percent of a 2 GiB move's budget) and a
        # refusal or failure at info, with its reason.
        if isinstance(outcome, MoveAcked):
            self.log.debug("move_acked", move_id=outcome.move_id, bytes_moved=outcome.bytes_moved,
                           bytes_freed_src=outcome.bytes_freed_src,
                           duration_ms=(outcome.finished_ns - outcome.started_ns) / 1e6)
        else:
            self.log.info("move_" + type(outcome).__name__.removeprefix("Move").lower(), move_id=outcome.move_id,
                          reason=getattr(outcome, "reason", None) or getattr(outcome, "error", None))
        return outcome

    # ------------------------------------------------------------ disk, invariants, teardown
    def _hash_disk_payload(self, block_id: int, words: torch.Tensor) -> int:
        row = words.view(1, -1)
        if self.torch_device.type == "cuda":
            row = row.to(self.torch_device)
        return checksums_to_ints(block_checksums(row, [0], [block_id]))[0]

    def check_integrity(self) -> None:
        """Raise IntegrityError with the numbers if any invariant of the worker's memory is broken."""
        for t in ("device", "host", "disk"):
            self.pool(t).check_integrity()
        self.pinned.check_integrity()
        grants = {g.grant_id: g for g in self.pinned.grants()}
        unregistered = [(c.buffer.owner, c.buffer.footprint_bytes) for c in self._closers
                        if grants.get(c.buffer.grant.grant_id) != c.buffer.grant
                        or c.buffer.grant.bytes != c.buffer.footprint_bytes]
        if unregistered:
            raise IntegrityError(f"pinned: buffers not registered as they are with the budget: {unregistered}")
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
        both = set(self._outcomes) & set(self._inflight)
        if both:
            raise IntegrityError(f"moves both in flight and settled: {sorted(both)[:8]}")
        wrong = [m for m, o in self._outcomes.items() if o.move_id != m]
        if wrong:
            raise IntegrityError(f"outcomes recorded under another move_id: {wrong[:8]}")

    def close(self) -> None:
        """Finish moves in flight, then unpin and release every pinned buffer."""
        for move_id in list(getattr(self, "_inflight", {})):
            self.wait(move_id)
        while self._closers:
            self._closers.pop().close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Engine", "MoveTicket", "default_copy_modes", "seeded_words"]
