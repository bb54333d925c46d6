"""The device KV pool a sleep gives back and its wake takes again, through the dial (loop thread only).

    shrink   a sleep (its sessions parked by now): the dial resizes the worker's device pool to one
             block, with its own plan, floor, evictions and write-ahead rebind (``ctl resize``'s
             path). A refusal is recorded and the sleep goes on: a sleep never waits on its pool
    grow     a wake that completed (or a sleep the worker refused): the pool goes back to the size
             the sleep took it from; the worker's requests wait for that resize's verdict

The size to grow back to: the ledger's (``ArenaState.kv_pool_bytes``, from the sleep's
FlipRequested, so a control restarted while asleep still knows it) first, else this object's
memory (``kv_before``: a sleep that shrank the pool and gave up before its FlipRequested).
A group's leader is resized and the dial resizes every rank with it (control/dialing.py).
"""
from __future__ import annotations

from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.control import flip, moves

log = structlog.get_logger("control.flip")


class KVPoolSteps:
    def __init__(self, proc, is_current: Callable[[object], bool]):
        self.proc = proc
        self.is_current = is_current      # the run is still its worker's (not finished meanwhile)
        # the device KV pool bytes each worker had before a sleep shrank it, until the sleep's
        # FlipRequested carries it into the ledger
        self.kv_before: dict[int, int] = {}

    def forget(self, worker: int) -> None:
        """A new incarnation starts with its pool at its own size."""
        self.kv_before.pop(worker, None)

    def before_sleep(self, worker: int) -> int | None:
        """The size a sleep's FlipRequested writes ahead: this loop's, else an earlier sleep's in
        the ledger (a pool shrunk before a restart)."""
        kv_pool = self.kv_before.get(worker)
        prior = flip.arena_of(self.proc.state, worker)
        if kv_pool is None and prior is not None:
            kv_pool = prior.kv_pool_bytes
        return kv_pool

    def shrink(self, run, then: Callable) -> None:
        """A sleep gives the device KV pool back too: resized to one block, the least it holds,
        unless its floor says otherwise; ``then(run)`` either way (at once when nothing to do)."""
        ws = self.proc.state.workers.get(run.worker)
        acc = ws.tiers.get("device") if ws is not None else None
        if run.plan.action != "sleep" or acc is None or acc.capacity_bytes <= ws.block_bytes:
            then(run)
            return
        run.phase = "shrinking"
        self._resize(run, ws.block_bytes, acc.capacity_bytes, then)

    def grow(self, run, then: Callable) -> bool:
        """Grow the pool back to the size a sleep took it from; False when it was not shrunk."""
        arena = flip.arena_of(self.proc.state, run.worker)
        to_bytes = arena.kv_pool_bytes if arena is not None else None
        if to_bytes is None:
            to_bytes = self.kv_before.get(run.worker)
        ws = self.proc.state.workers.get(run.worker)
        if to_bytes is None or ws is None or not ws.alive:
            return False
        run.phase = "growing"
        self._resize(run, to_bytes, ws.tiers["device"].capacity_bytes, then)
        return True

    def _resize(self, run, to_bytes: int, from_bytes: int, then: Callable) -> None:
        origin = flip.kv_pool_origin(run.origin)
        causation = run.causation or run.origin
        waiter = moves.AskWaiter(f"{run.ref}:{flip.KV_POOL}",
                                 lambda events, *_a, run=run: self._resized(run, events, then))
        dialer = getattr(self.proc, "dial", None)
        try:
            if dialer is None:
                raise moves.InvalidAsk("this control process has no dial")
            dialer.resize(run.worker, "device", to_bytes, origin, waiter, causation=causation,
                          sleeping=run.phase == "shrinking")
        except moves.InvalidAsk as e:     # nothing recorded by the dial: the refusal is recorded here
            refused = ev.MoveRefused(ask=origin, worker=run.worker, tier="device", asked_bytes=to_bytes,
                                     available_bytes=from_bytes, floor_bytes=0,
                                     reason=f"resize of the device pool of worker {run.worker} to {to_bytes}: {e}")
            log.warning("kv_pool_not_resized", worker=run.worker, action=run.plan.action, reason=str(e))
            run.waiter.events.append((self.proc.record(refused, causation=causation), refused))
            then(run)

    def _resized(self, run, events: list, then: Callable) -> None:
        run.waiter.events.extend(events)
        for _, e in events:
            if type(e) is ev.PoolResized and e.pool == "device" and e.worker == run.worker:
                if run.phase == "shrinking":    # a pool already shrunk by an earlier sleep keeps its first size
                    self.kv_before.setdefault(run.worker, e.from_bytes)
                else:
                    self.kv_before.pop(run.worker, None)
        log.info("kv_pool_resized", worker=run.worker, action=run.plan.action, phase=run.phase,
                 outcome=flip.kv_pool_outcome([e for _, e in events]))
        if self.is_current(run):
            then(run)


__all__ = ["KVPoolSteps"]
