"""The control loop's start and stop.

    start  replay the ledger (snapshot + tail); the loop's fields; ServerStarted; after a crash,
           workers the ledger says were serving get ``adopt_grace_s`` to come back
    stop   settle what is in flight (abandoned past the grace), free every copy by the book
           (a release nobody answers is stranded, never zero), ServerStopped, Shutdown to workers

``StartStop`` is a part of ``ControlProc`` (control/proc.py): ``_recover`` runs first on the loop
thread and makes every field the other parts use.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import structlog

from residency.events import catalog as ev
from residency.events.commands import Shutdown
from residency.control import moves, recovery
from residency.control.policy import RefusalMemo, release
from residency.control.recorder import Recorder
from residency.control.state import index_copies

log = structlog.get_logger("control.startstop")
S = 1_000_000_000
SERVER_VERSION = "0.1.0"


class StartStop:
    """Recovery at start, settling at stop (a part of ControlProc; loop thread only)."""

    def _recover(self) -> None:
        t0 = time.monotonic()
        rec = recovery.replay(self.store)
        self.recovered = rec
        self.state, self.recency, self.epoch, self.roster = rec.state, rec.recency, rec.epoch, dict(rec.roster)
        index_copies(self.state)            # the copy index asks are checked against, kept by the fold from now on
        self._writer = self._writer_factory(self.store)
        self._recorder = Recorder(self.store, self._writer, self.state, self.recency, self.epoch, self.faults,
                                  self.cfg.durability, inline_max=1000 if self.cfg.commit_inline else 0)
        self.book = moves.MoveBook()
        self.busy = moves.BusyIndex(self.state)
        # stranded moves their worker has answered for with a failure (or "never received"):
        # they will never land, so they hold neither blocks nor room. The ledger has no event for
        # that answer (only a late ack or a release's CopiesReleased resolves a stranding), so they
        # stay listed stranded there.
        self.answered_stranded: set[str] = set()
        self.memo = RefusalMemo()
        self._links: dict[bytes, WorkerLink] = {}
        self._lanes: dict[bytes, WorkerLink] = {}        # engine lane identity -> its worker's link
        self._early_lanes: dict[bytes, int] = {}         # LaneHellos ahead of their Hello: identity -> epoch
        self._by_worker: dict[int, WorkerLink] = {}
        self._answers: collections.deque = collections.deque()   # (seq needed, waiter)
        self._commits_pending: dict[str, tuple] = {}            # commit ref -> (waiter, worker, tier, session, bytes, deadline)
        self._unsent: dict[int, list[ev.MoveRequested]] = {}     # committed, but the worker was not linked
        self._snapshot_pending: tuple | None = None
        self._num_moves = 0
        self._num_refs = 0
        self._next_block: dict[int, int] = {}
        self._ask_ns = self._recv_ns = 0
        now = time.monotonic_ns()
        self._next = {"ping": now, "policy": now, "watchdog": now, "requery": now, "quiet": now + 3600 * S}
        self._next_park = now
        self._last_ckpt = (self._recorder.producer_seq, now)
        self._last_snapshot_seq = rec.from_snapshot
        # Workers the ledger says are serving: after a crash they get a grace to come back.
        alive = [w for w, ws in self.state.workers.items() if ws.alive]
        self._adopting: dict[int, int] = {w: now + int(self.cfg.adopt_grace_s * S) for w in alive} if rec.crashed else {}
        self._stopped_cleanly = not rec.crashed     # the last incarnation recorded ServerStopped
        self._replacing: dict[int, int] = {}         # worker -> until when its disk copies wait (links.py)
        self._record(ev.ServerStarted(version=SERVER_VERSION, config_digest=self.cfg.config_digest))
        self._recorder.flush()
        log.info("control_recovered", last_seq=rec.last_seq, replayed=rec.num_replayed, snapshot=rec.from_snapshot,
                 epoch=self.epoch, crashed=rec.crashed, in_flight=len(self.state.inflight),
                 stranded=len(self.state.stranded), adopting=sorted(self._adopting),
                 seconds=round(time.monotonic() - t0, 3))

    def _shutdown(self, reason: str) -> None:
        """Settle what is in flight, free every copy by the book (but the disk copies, with
        ``keep_disk``), record ServerStopped, stop workers."""
        log.info("control_stopping", reason=reason, in_flight=len(self.state.inflight))
        self._serve_until(lambda: not self.state.inflight, self.cfg.shutdown_grace_s)
        for mid, mv in list(self.state.inflight.items()):
            self._settle(mid, ev.MoveAbandoned(move_id=mid, worker=mv.worker, why=f"server stopping: {reason}"))
        if self.cfg.release_on_stop:
            for w, link in list(self._by_worker.items()):
                by_tier: dict[str, list[int]] = {}
                for b, st in self.state.blocks.get(w, {}).items():
                    for t in st.tiers:
                        if t != "disk" or not self.cfg.keep_disk:
                            by_tier.setdefault(t, []).append(b)
                for tier, blocks in by_tier.items():
                    req = self._request(release("control:stop", w, tier, blocks, "server stopping"), None)
                    log.debug("release_on_stop", worker=w, tier=tier, blocks=len(blocks), move_id=req)
            self._serve_until(lambda: not self.state.inflight, self.cfg.shutdown_grace_s)
            for mid, mv in list(self.state.inflight.items()):   # unanswered releases: silence is not zero
                self._settle(mid, ev.MoveStranded(move_id=mid, worker=mv.worker, bytes_at_risk=mv.bytes_planned,
                                                  why="silent_release"))
        self._record(ev.ServerStopped(reason=reason))
        self._recorder.flush()
        self._writer.flush(timeout=30)
        self._recorder.advance()
        for link in list(self._links.values()):
            self._send(link, Shutdown(reason=reason))
        self._answers_flush()
        log.info("control_stopped", reason=reason, last_seq=self._recorder.committed)

    def _serve_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._poll()
            self._recorder.flush()
            self._commits()

    def _answers_flush(self) -> None:
        while self._answers:
            self._answer(self._answers.popleft()[1])
