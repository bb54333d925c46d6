"""The control loop's start and stop.

    start  replay the ledger (snapshot + tail) and index the copies (``recover``); the loop
           composes its parts around the result and records ServerStarted; after a crash,
           workers the ledger says were serving get ``adopt_grace_s`` to come back (WorkerRegistry)
    stop   settle what is in flight (abandoned past the grace), free every copy by the book
           (a release nobody answers is stranded, never zero), ServerStopped, Shutdown to workers
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, BlocksWritten, CommandFailed, DiskClaimed, ErrorReply, Hello, MoveNearlyDone, MovesReport,
    MemoryReport, MoveTimed, PinnedChanged, PoolRebound, Pong,
)
from residency.control import moves, recovery
from residency.control.memory_probes import MemoryProbes
from residency.control.answers import Answers
from residency.control.asking import AskHandler
from residency.control.awake_poll import AwakePoll
from residency.control.config import ControlConfig
from residency.control.dialing import Dial
from residency.control.keep_awake import AwakeWhileMoving, KeepAwake
from residency.control.lifecycle import MoveDispatcher
from residency.control.links import WorkerRegistry
from residency.control.policy import release
from residency.control.probes import ControlFaults, MoveTraces
from residency.control.recorder import Checkpoints, Recorder
from residency.control.state import State, index_copies
from residency.control.transport import AskServer, WorkerRouter

log = structlog.get_logger("control.startstop")
SERVER_VERSION = "0.1.0"


def recover(store) -> recovery.Recovered:
    """The ledger replayed, with the copy index that asks are checked against (kept by the fold
    from now on)."""
    t0 = time.monotonic()
    rec = recovery.replay(store)
    index_copies(rec.state)
    log.info("control_recovered", last_seq=rec.last_seq, replayed=rec.num_replayed, snapshot=rec.from_snapshot,
             epoch=rec.epoch, crashed=rec.crashed, in_flight=len(rec.state.inflight),
             stranded=len(rec.state.stranded), seconds=round(time.monotonic() - t0, 3))
    return rec


class Parts:
    """The control loop's parts, composed around the replayed ledger (``rec``); each gets what it
    needs here. ``handlers`` (worker message type -> handler) is filled with the parts' own, but
    for types registered before (the serving path's)."""

    def __init__(self, store, cfg: ControlConfig, rec: recovery.Recovered, writer, router: WorkerRouter,
                 ask_server: AskServer | None, traces: MoveTraces, faults: ControlFaults,
                 metrics: collections.Counter, listeners: list, handlers: dict[type, Callable],
                 blocks_in_use: Callable[[], dict[int, set[int]]], stopping: Callable[[], bool], health: Callable,
                 worker_gone: Callable[[int], None] = lambda w: None, pool_readers: dict | None = None):
        state, recency, epoch, now = rec.state, rec.recency, rec.epoch, time.monotonic_ns()
        self.recorder = recorder = Recorder(store, writer, state, recency, epoch, faults, cfg.durability,
                                            1000 if cfg.commit_inline else 0, listeners, metrics)
        self.checkpoints = Checkpoints(store, state, recency, recorder, cfg.checkpoint_every_events,
                                       cfg.checkpoint_every_s, cfg.snapshot_every_events, rec.from_snapshot, now)
        book, busy = moves.MoveBook(), moves.BusyIndex(state)
        self.keep_awake = (AwakeWhileMoving(KeepAwake(), cfg.keep_awake_min_bytes, cfg.keep_awake_linger_s)
                           if cfg.keep_awake else None)
        self.answers = Answers(recorder, book, traces, metrics, cfg.answer_yield_min_blocks)
        self.awake = AwakePoll(state, recorder, traces, metrics, cfg.ack_spin_max_us, cfg.warm_lead_us)
        # the registry settles a lost worker's moves, and the dispatcher sends what waited for a
        # worker once it joins: each is handed the other's method (the dispatcher is made next)
        self.workers = WorkerRegistry(cfg, state, dict(rec.roster), router, recorder, book, busy, metrics, handlers,
                                      rec.crashed, lambda mid, e: self.moves.settle(mid, e),
                                      lambda w: self.moves.worker_joined(w), worker_gone)
        self.moves = MoveDispatcher(cfg, state, recency, epoch, recorder, book, busy, self.workers, self.answers,
                                    self.awake, self.keep_awake, traces, faults, metrics, blocks_in_use)
        self.memory = MemoryProbes(lambda: state, self.workers, blocks_in_use)
        self.dial = Dial(state, recency, epoch, recorder, self.workers, self.moves, self.answers, blocks_in_use,
                         pool_readers, cfg.rebind_deadline_s)
        self.moves.holds = self.dial.holds
        self.asks = AskHandler(cfg, state, epoch, rec.crashed, recorder, ask_server, self.workers, self.moves,
                               self.answers, metrics, stopping, health, memory=self.memory.begin, dialer=self.dial)
        for types, handler in (
                ((Hello,), self.workers.on_hello), ((Pong,), self.workers.on_pong),
                ((PinnedChanged,), self.workers.on_pinned_changed), ((MemoryReport,), self.memory.on_report),
                ((ErrorReply,), self.workers.on_worker_error), ((DiskClaimed,), self.workers.on_disk_claimed),
                ((ev.MoveAcked, ev.MoveFailed, ev.MoveRejected), self.moves.on_outcome),
                ((BlocksReleased,), self.moves.on_released), ((MovesReport,), self.moves.on_report),
                ((MoveTimed,), self.moves.on_timed), ((MoveNearlyDone,), self.awake.on_nearly_done),
                ((BlocksWritten,), self.asks.on_written), ((CommandFailed,), self.asks.on_command_failed),
                ((PoolRebound,), self.dial.on_rebound)):
            for t in types:
                handlers.setdefault(t, handler)    # one registered before start (on_worker_message) wins
        if self.workers.adopting:
            log.info("control_adopting", workers=sorted(self.workers.adopting), grace_s=cfg.adopt_grace_s)


def shut_down(reason: str, cfg: ControlConfig, state: State, recorder: Recorder, writer,
              workers: WorkerRegistry, dispatcher: MoveDispatcher, answers: Answers,
              serve_until: Callable[[Callable[[], bool], float], None]) -> None:
    """Settle what is in flight, free every copy by the book (but the disk copies, with
    ``keep_disk``), record ServerStopped, stop workers. ``serve_until(done, timeout_s)`` runs
    the loop (without ticks) until ``done()`` or the timeout."""
    log.info("control_stopping", reason=reason, in_flight=len(state.inflight))
    serve_until(lambda: not state.inflight, cfg.shutdown_grace_s)
    for mid, mv in list(state.inflight.items()):
        dispatcher.settle(mid, ev.MoveAbandoned(move_id=mid, worker=mv.worker, why=f"server stopping: {reason}"))
    if cfg.release_on_stop:
        for w in list(workers.by_worker):
            by_tier: dict[str, list[int]] = {}
            for b, st in state.blocks.get(w, {}).items():
                for t in st.tiers:
                    if t != "disk" or not cfg.keep_disk:
                        by_tier.setdefault(t, []).append(b)
            for tier, blocks in by_tier.items():
                mid = dispatcher.request(release("control:stop", w, tier, blocks, "server stopping"), None)
                log.debug("release_on_stop", worker=w, tier=tier, blocks=len(blocks), move_id=mid)
        serve_until(lambda: not state.inflight, cfg.shutdown_grace_s)
        for mid, mv in list(state.inflight.items()):   # unanswered releases: silence is not zero
            dispatcher.settle(mid, ev.MoveStranded(move_id=mid, worker=mv.worker, bytes_at_risk=mv.bytes_planned,
                                                   why="silent_release"))
    workers.release_pinned(reason)
    recorder.record(ev.ServerStopped(reason=reason))
    recorder.flush()
    writer.flush(timeout=30)
    recorder.advance()
    workers.shutdown_all(reason)
    answers.send_all()
    log.info("control_stopped", reason=reason, last_seq=recorder.committed)
