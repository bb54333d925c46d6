"""Light bookkeeping the detectors share: block copies per (worker, tier), moves in flight,
stranded moves, requests in hand and queued, and the server's starts and stops.

NOTE: this is deliberately not ``control.fold``. The fold is the authority (hash-checked state,
integrity invariants); diagnosing a million events in seconds needs only byte counts, so this
keeps sets of block ids per (worker, tier) and multiplies by ``WorkerJoined.block_bytes``. It
follows the design's rule that residency changes only on acked bytes: a move's destination gets
its blocks on ``MoveAcked``/``MoveLateAcked``, never on ``MoveRequested``.
"""
from __future__ import annotations

from typing import Callable

from residency.events import (
    BlocksCommitted,
    BlocksFreed,
    CopiesReleased,
    MoveAbandoned,
    MoveAcked,
    MoveFailed,
    MoveLateAcked,
    MoveLateFailed,
    MoveRejected,
    MoveRequested,
    MoveStranded,
    Recorded,
    RequestAdmitted,
    RequestFinished,
    RequestQueued,
    RequestRefused,
    ServerStarted,
    ServerStopped,
    StateCheckpoint,
    StepCompleted,
    WorkerHeartbeatMissed,
    WorkerJoined,
    WorkerLost,
)

# (the event that changed it, worker, tier, used_bytes after the change)
UsageListener = Callable[[Recorded, int, str, int], None]


class Accounting:
    def __init__(self) -> None:
        self.block_bytes: dict[int, int] = {}              # worker -> bytes per block
        self.capacity: dict[tuple[int, str], int] = {}     # (worker, tier) -> capacity_bytes
        self.copies: dict[tuple[int, str], set[int]] = {}  # (worker, tier) -> block ids
        self.lost: set[int] = set()
        self.resident_at_loss: dict[int, int] = {}         # worker -> bytes of its distinct blocks when lost
        self.inflight: dict[str, Recorded] = {}            # move_id -> its MoveRequested
        self.stranded: dict[str, tuple[Recorded, Recorded]] = {}  # move_id -> (MoveStranded, MoveRequested)
        self.waiting: dict[str, Recorded] = {}             # request_id -> its RequestAdmitted
        self.queued: dict[str, Recorded] = {}              # request_id -> its RequestQueued, until it leaves the queue
        # NOTE: a request admitted before the server stopped or crashed cannot progress after it: it
        # is no longer waiting (so no stall counts it) but orphaned, until recovery closes it.
        self.orphaned: dict[str, Recorded] = {}            # request_id -> its RequestAdmitted
        self.running = False                                # a ServerStarted with no ServerStopped since
        self.last_life_ns: int | None = None                # the latest event that shows a process at work
        self.last_life_seq: int | None = None               # ... and its seq
        self.before_start_ns: int | None = None             # at a ServerStarted: the one before it
        self.before_start_seq: int | None = None
        self.after_crash = False                            # at a ServerStarted: no ServerStopped came before it
        self.usage_listeners: list[UsageListener] = []
        # NOTE: the move a terminal event just ended (and its stranding, for a late ack), so that
        # detectors registered after this class can still see what was asked.
        self.ended: Recorded | None = None
        self.ended_stranding: Recorded | None = None

    # ------------------------------------------------------------ queries
    def used_bytes(self, worker: int, tier: str) -> int:
        s = self.copies.get((worker, tier))
        return len(s) * self.block_bytes.get(worker, 0) if s else 0

    def free_bytes(self, worker: int, tier: str) -> int | None:
        cap = self.capacity.get((worker, tier))
        return None if cap is None else cap - self.used_bytes(worker, tier)

    def workers(self) -> list[int]:
        return sorted(self.block_bytes)

    # ------------------------------------------------------------ updates
    def handlers(self):
        return {
            WorkerJoined: self._joined,
            WorkerLost: self._lost,
            BlocksCommitted: self._committed,
            BlocksFreed: self._freed,
            MoveRequested: self._requested,
            MoveAcked: self._acked,
            MoveLateAcked: self._late_acked,
            MoveLateFailed: self._late_failed,
            CopiesReleased: self._released,
            MoveFailed: self._ended,
            MoveRejected: self._ended,
            MoveAbandoned: self._ended,
            MoveStranded: self._stranded,
            RequestAdmitted: self._admitted,
            RequestFinished: self._finished,
            RequestRefused: self._finished,
            RequestQueued: self._queued,
            ServerStarted: self._started,
            ServerStopped: self._stopped,
            StepCompleted: self._life,
            StateCheckpoint: self._life,
            WorkerHeartbeatMissed: self._life,
        }

    def _changed(self, rec: Recorded, worker: int, tier: str) -> None:
        if self.usage_listeners:
            used = len(self.copies[(worker, tier)]) * self.block_bytes.get(worker, 0)
            for fn in self.usage_listeners:
                fn(rec, worker, tier, used)

    def _copies(self, worker: int, tier: str) -> set[int]:
        s = self.copies.get((worker, tier))
        if s is None:
            s = self.copies[(worker, tier)] = set()
        return s

    def _joined(self, rec: Recorded) -> None:
        ev: WorkerJoined = rec.event
        self.block_bytes[ev.worker] = ev.block_bytes
        self.lost.discard(ev.worker)
        for tier, cap in ev.tiers.items():
            self.capacity[(ev.worker, tier)] = cap
            self._copies(ev.worker, tier).clear()
            self._changed(rec, ev.worker, tier)

    def _lost(self, rec: Recorded) -> None:
        w = rec.event.worker
        self.lost.add(w)
        blocks: set[int] = set()
        for (worker, _), s in self.copies.items():
            if worker == w:
                blocks |= s
        kept = set(rec.event.kept_on_disk)           # disk copies the next incarnation found
        self.resident_at_loss[w] = len(blocks - kept) * self.block_bytes.get(w, 0)
        for (worker, tier), s in self.copies.items():
            if worker == w and s:
                before = len(s)
                if tier == "disk" and kept:
                    s.intersection_update(kept)
                else:
                    s.clear()
                if len(s) != before:
                    self._changed(rec, w, tier)

    def _committed(self, rec: Recorded) -> None:
        ev: BlocksCommitted = rec.event
        if ev.worker not in self.block_bytes and ev.blocks:
            # a ledger that starts after the join: infer the block size from the first commit
            self.block_bytes[ev.worker] = ev.bytes // len(ev.blocks)
        self._copies(ev.worker, ev.tier).update(ev.blocks)
        self._changed(rec, ev.worker, ev.tier)

    def _freed(self, rec: Recorded) -> None:
        ev: BlocksFreed = rec.event
        self._copies(ev.worker, ev.tier).difference_update(ev.blocks)
        self._changed(rec, ev.worker, ev.tier)

    def _requested(self, rec: Recorded) -> None:
        self.inflight[rec.event.move_id] = rec
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _arrive(self, req: MoveRequested, rec: Recorded) -> None:
        self._copies(req.worker, req.dst).update(req.blocks)
        self._changed(rec, req.worker, req.dst)
        if not req.keep_source and req.src != req.dst:
            self._copies(req.worker, req.src).difference_update(req.blocks)
            self._changed(rec, req.worker, req.src)

    def _acked(self, rec: Recorded) -> None:
        req = self.ended = self.inflight.pop(rec.event.move_id, None)
        if req is not None and rec.event.worker not in self.lost:
            self._arrive(req.event, rec)

    def _late_acked(self, rec: Recorded) -> None:
        hit = self.stranded.pop(rec.event.move_id, None)
        self.ended_stranding, self.ended = hit if hit is not None else (None, None)
        if hit is not None and rec.event.worker not in self.lost:
            self._arrive(hit[1].event, rec)

    def _late_failed(self, rec: Recorded) -> None:
        """A stranding closed by its worker: it never landed, so nothing arrives."""
        hit = self.stranded.pop(rec.event.move_id, None)
        self.ended_stranding, self.ended = hit if hit is not None else (None, None)

    def _released(self, rec: Recorded) -> None:
        """A release answered: settled like an ack (late when it was stranded), then its copies
        freed; the steps the two rows of older ledgers (ack, then BlocksFreed) took."""
        if rec.event.move_id in self.stranded:
            self._late_acked(rec)
        else:
            self._acked(rec)
            self.ended_stranding = None
        self._freed(rec)

    def is_late(self) -> bool:
        """Whether the release or ack just handled ended a stranding (``ended_stranding``)."""
        return self.ended_stranding is not None

    def _ended(self, rec: Recorded) -> None:
        self.ended = self.inflight.pop(rec.event.move_id, None)

    def _stranded(self, rec: Recorded) -> None:
        req = self.ended = self.inflight.pop(rec.event.move_id, None)
        if req is not None:
            self.stranded[rec.event.move_id] = (rec, req)

    def _admitted(self, rec: Recorded) -> None:
        self.waiting[rec.event.request_id] = rec
        self.queued.pop(rec.event.request_id, None)
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _finished(self, rec: Recorded) -> None:
        rid = rec.event.request_id
        self.waiting.pop(rid, None)
        self.queued.pop(rid, None)
        self.orphaned.pop(rid, None)
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _queued(self, rec: Recorded) -> None:
        self.queued[rec.event.request_id] = rec
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _life(self, rec: Recorded) -> None:
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _orphan_all(self) -> None:
        """Whatever was in hand belonged to a process that is gone: its queue (memory only) is
        dropped, its admitted requests are orphaned."""
        self.orphaned.update(self.waiting)
        self.waiting.clear()
        self.queued.clear()

    def _started(self, rec: Recorded) -> None:
        self.before_start_ns, self.before_start_seq = self.last_life_ns, self.last_life_seq
        self.after_crash = self.running
        self._orphan_all()
        self.running = True
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq

    def _stopped(self, rec: Recorded) -> None:
        self._orphan_all()
        self.running = False
        self.last_life_ns, self.last_life_seq = rec.envelope.ts_ns, rec.envelope.seq
