"""The worker's side of the dial: resize the device KV pool and rebind every reader of it.

    ResizePool ─► refused up front (nothing changed): a move in flight, live blocks that do not
                  fit, a new tensor the machine cannot hold, scratch the pinned budget cannot fund,
                  a generation that does not move forward
               └► DevicePool.resize: relocate, new tensor, copy, drop the old one
                  then every reader binds to ``to_gen`` (a refusal, or a ``miss_stamp`` fault,
                  leaves it behind: the pool is torn until a complete rebind)
                  then the allocator's and the driver's counters are read again
               ─► PoolRebound{stamps, refused, measured bytes, ...}

It runs on the device thread, in order with moves and serving steps, so no step runs meanwhile.
The mover and staging readers live here; the serving loop and CUDA graphs bind themselves.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from residency.dataplane.pools import DataPlaneError, PinnedBudgetExceeded, ReaderRefused, ResizeRefused
from residency.dataplane.pools.readers import check_fits
from residency.events.commands import PoolRebound, ResizePool

log = structlog.get_logger("dataplane.rebind")
KEEP_ANSWERS = 64          # answers kept for a ResizePool sent again


class MoverReader:
    """The mover's move context: the pool's words (read at each move) and the slot-index scratch
    sized by the larger pool. Binding grows that scratch through the pinned budget."""

    name = "mover"

    def __init__(self, mover):
        self.mover = mover
        self.gen = -1

    def bind(self, pool, gen: int) -> None:
        m = self.mover
        if pool is not m.device_pool:
            raise ReaderRefused(self.name, "not the pool this mover's moves address")
        check_fits(self.name, pool.tensor, m.layout.block_shape, m.layout.dtype, m.torch_device)
        if m.num_inflight:
            raise ReaderRefused(self.name, f"{m.num_inflight} moves in flight")
        try:
            m.tiers.grow_index_scratch(pool.num_slots)
        except PinnedBudgetExceeded as e:
            raise ReaderRefused(self.name, str(e)) from e
        self.gen = gen
        pool.stamp(self.name, gen)


class StagingReader:
    """The host staging of the mover's moves: the checksum landing row (sized by slot count) and
    the device<->disk staging ring (block-sized rows)."""

    name = "staging"

    def __init__(self, tiers):
        self.tiers = tiers
        self.gen = -1

    def bind(self, pool, gen: int) -> None:
        t = self.tiers
        if t.ring.rows.shape[1] != pool.layout.block_words:
            raise ReaderRefused(self.name, f"staging rows of {t.ring.rows.shape[1]} words, pool blocks of "
                                f"{pool.layout.block_words}")
        try:
            t.grow_landing(pool.num_slots)
        except PinnedBudgetExceeded as e:
            raise ReaderRefused(self.name, str(e)) from e
        self.gen = gen
        pool.stamp(self.name, gen)


def attach_mover_readers(mover) -> None:
    """Register the mover's two readers with its device pool."""
    pool = mover.device_pool
    pool.add_reader(MoverReader(mover))
    pool.add_reader(StagingReader(mover.tiers))


class Rebinder:
    """Answers ``ResizePool`` for one worker (device thread only). ``miss_stamp()``: the name of a
    reader that must not stamp on this rebind (a fault hook; None: all stamp)."""

    def __init__(self, mover, worker: int, miss_stamp: Callable[[], str | None] = lambda: None,
                 clock: Callable[[], int] = time.time_ns):
        self.mover = mover
        self.pool = mover.device_pool
        self.worker = worker
        self.miss_stamp = miss_stamp
        self.clock = clock
        self._answers: dict[str, PoolRebound] = {}      # rebind_id -> its answer, the last few
        self.log = log.bind(worker=worker)

    def status(self) -> tuple[int, list[str]]:
        """(the pool's generation, its readers), for Hello and ServingReady."""
        return self.pool.gen, sorted(self.pool.readers)

    def handle(self, cmd: ResizePool) -> list:
        """The answer to ``cmd``; a ResizePool sent again (same rebind_id) gets the same answer and
        resizes nothing twice."""
        done = self._answers.get(cmd.rebind_id)
        if done is None:
            done = self._answers[cmd.rebind_id] = self.resize(cmd)
            while len(self._answers) > KEEP_ANSWERS:
                self._answers.pop(next(iter(self._answers)))
        return [done]

    def resize(self, cmd: ResizePool) -> PoolRebound:
        pool, started = self.pool, self.clock()
        base = dict(rebind_id=cmd.rebind_id, worker=self.worker, tier=cmd.tier, from_gen=pool.gen,
                    to_gen=cmd.to_gen, from_slots=pool.num_slots, to_slots=pool.num_slots,
                    from_bytes=pool.capacity_bytes, to_bytes=pool.capacity_bytes, started_ns=started)

        def refuse(why: str) -> PoolRebound:
            self.log.warning("resize_refused", rebind_id=cmd.rebind_id, num_slots=cmd.num_slots, why=why)
            return PoolRebound(**base, finished_ns=self.clock(), error=why)

        if cmd.tier != "device":
            return refuse(f"only the device pool can be resized, not {cmd.tier!r}")
        if self.mover.num_inflight:
            return refuse(f"{self.mover.num_inflight} moves in flight: resize refused, nothing changed")
        if cmd.to_gen <= pool.gen:
            return refuse(f"to_gen {cmd.to_gen} does not move forward from gen {pool.gen}")
        _, refused = pool.resize_refusal(cmd.num_slots)
        if refused is not None:
            return refuse(str(refused))
        grow = self.mover.tiers.scratch_growth_bytes(cmd.num_slots)
        refused = self.mover.pinned.refusal("device-pool-scratch", grow) if grow else None
        if refused is not None:
            return refuse(f"the slot scratch of {cmd.num_slots} slots needs {grow} more pinned bytes: {refused}")
        missed = self.miss_stamp()
        stamps: dict[str, int] = {}
        refusals: dict[str, str] = {}

        def bind_all() -> None:
            for name, reader in list(pool.readers.items()):
                if name == missed:
                    self.log.warning("fault_injected_missed_stamp", rebind_id=cmd.rebind_id, reader=name)
                    continue
                try:
                    reader.bind(pool, cmd.to_gen)
                except ReaderRefused as e:
                    refusals[name] = e.why
                    continue
                stamps[name] = pool.stamps[name]

        try:
            done = pool.resize(cmd.num_slots, cmd.to_gen, then=bind_all)
        except ResizeRefused as e:
            return refuse(str(e))
        except DataPlaneError as e:          # e.g. the new tensor failed to allocate after all
            return refuse(f"{type(e).__name__}: {e}")
        out = PoolRebound(
            **{**base, "to_slots": done.to_slots, "to_bytes": done.to_bytes}, stamps=stamps, refused=refusals,
            blocks_relocated=done.blocks_relocated, measured_freed_bytes=done.measured_freed_bytes,
            allocator_freed_bytes=done.allocator_freed_bytes, finished_ns=self.clock())
        self.log.info("pool_rebound", rebind_id=cmd.rebind_id, from_gen=out.from_gen, to_gen=out.to_gen,
                      from_slots=out.from_slots, to_slots=out.to_slots, relocated=out.blocks_relocated,
                      stamps=sorted(stamps), refused=refusals, behind=sorted(pool.behind()),
                      measured_freed_bytes=out.measured_freed_bytes)
        return out


__all__ = ["MoverReader", "StagingReader", "Rebinder", "attach_mover_readers"]
