"""The worker's core: what it does with each command, and the record of what it did. No sockets.

``WorkerCore.run(cmd)`` runs on the worker's one engine thread and returns the replies to send.
``WorkerRecord`` lives on the I/O thread: every outcome by move_id (moves and releases), the
commands still running, and the ids it promised never to run (answered "unknown" to a
``QueryMoves``: the control process then records them abandoned, so a stale command still in a
pipe must be refused, never executed).

New message types (the serving path's ``Generate`` ...) join by ``WorkerCore.register``.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, BlocksWritten, ClaimDisk, CommandFailed, CommitBlocks, DiskClaimed, ExecuteMove, Inventory,
    MovesReport, QueryInventory, ReleaseBlocks,
)

log = structlog.get_logger("dataplane.worker")
Outcome = ev.MoveAcked | ev.MoveFailed | ev.MoveRejected
# replies that are a command's outcome (encoded once, and held or dropped by the reply faults)
OUTCOMES = (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected, BlocksReleased)


def command_ref(cmd) -> str | None:
    """The id a command is known by: its move_id, release_id or request_id."""
    return getattr(cmd, "move_id", None) or getattr(cmd, "release_id", None) or getattr(cmd, "request_id", None)


class WorkerFaults:
    """Fault hooks for the fault tests. All OFF unless named (``--faults`` or RESIDENCY_WORKER_FAULTS):

        drop_ack=P           a move's outcome is never sent (the watchdog strands it; a re-query
                             brings it back as a late ack)
        delay_ack=P:MS       an outcome is held MS ms before it is sent
        duplicate_ack=P      an outcome is sent twice
        reorder_ack=P        an outcome is held back and sent after the next one
        silent_release=P     a release is carried out and never answered
        zero_release=P       a release is answered with bytes_freed=0
        crash_after_moves=N  SIGKILL self right after executing the Nth move, before its ack
        exec_delay_ms=MS     every move pauses MS ms half-way (after the engine's submit, before its
                             wait), so a test can kill the worker in the middle of a move
        seed=S               the random source of the probabilities above
    """

    PROBABILITIES = ("drop_ack", "duplicate_ack", "reorder_ack", "silent_release", "zero_release")

    def __init__(self, spec: str = ""):
        self.p: dict[str, float] = {}
        self.delay_p, self.delay_ms = 0.0, 0.0
        self.crash_after_moves = 0
        self.exec_delay_ms = 0.0
        seed = 0
        for part in filter(None, (x.strip() for x in spec.split(","))):
            name, _, value = part.partition("=")
            if name in self.PROBABILITIES:
                self.p[name] = float(value)
            elif name == "delay_ack":
                p, _, ms = value.partition(":")
                self.delay_p, self.delay_ms = float(p), float(ms or 100)
            elif name == "crash_after_moves":
                self.crash_after_moves = int(value)
            elif name == "exec_delay_ms":
                self.exec_delay_ms = float(value)
            elif name == "seed":
                seed = int(value)
            else:
                raise ValueError(f"unknown worker fault {name!r}; see dataplane.worker.WorkerFaults")
        self.rng = random.Random(seed)
        self.enabled = bool(self.p or self.delay_p or self.crash_after_moves or self.exec_delay_ms)
        # faults that hold, drop, repeat or rewrite what is sent: they live on the I/O thread's
        # timers, so a worker with any of them sends everything from there (no engine lane)
        self.on_replies = bool(self.p or self.delay_p)
        self.counts: dict[str, int] = {}

    def roll(self, name: str) -> bool:
        p = self.p.get(name, 0.0)
        hit = p > 0 and self.rng.random() < p
        if hit:
            self.counts[name] = self.counts.get(name, 0) + 1
        return hit

    def roll_delay_s(self) -> float:
        if self.delay_p > 0 and self.rng.random() < self.delay_p:
            self.counts["delay_ack"] = self.counts.get("delay_ack", 0) + 1
            return self.delay_ms / 1000
        return 0.0


class WorkerCore:
    """Runs commands against the engine. Engine-thread only."""

    def __init__(self, engine, worker: int, faults: WorkerFaults | None = None,
                 expected_errors: tuple[type[BaseException], ...] = ()):
        self.engine = engine
        # the engine's "no" (no room, not resident, busy): answered as CommandFailed, named
        self.expected_errors = expected_errors or (NoCopyError,)
        self.worker = worker
        self.faults = faults or WorkerFaults()
        self.num_moves = 0
        self.handlers: dict[type, Callable[[Any], list]] = {
            ExecuteMove: self.execute, CommitBlocks: self.commit, ReleaseBlocks: self.release,
            QueryInventory: self.inventory, ClaimDisk: self.claim_disk,
        }
        # files of an earlier incarnation the engine found on its disk and verified (--keep-disk),
        # offered in Hello until the control's ClaimDisk says which to keep
        report = getattr(engine, "disk_report", None)
        self.unclaimed_disk: list[int] = sorted(report.indexed) if report is not None else []
        if report is not None and (report.indexed or report.quarantined):
            log.info("disk_rebuilt", worker=worker, found=len(report.indexed), quarantined=report.quarantined,
                     removed_temporaries=len(report.removed_temporaries))
        # Set by dataplane.serving_worker.attach: the work the engine thread does while no command
        # waits (has_work, step -> replies), and the messages that follow every Hello.
        self.background: tuple[Callable[[], bool], Callable[[], list]] | None = None
        self.hello_extras: Callable[[], list] = lambda: []
        # commands that read no engine state (Tokenize): a worker process runs them on its side
        # threads (dataplane/side.py), so a long one never holds up the engine thread's steps
        self.side_handlers: dict[type, Callable[[Any], list]] = {}
        # an early-started move (``start_ahead``): its command, and when it began (wall ns)
        self.ahead: ExecuteMove | None = None
        self.ahead_ns = 0

    def register(self, msg_type: type, handler: Callable[[Any], list]) -> None:
        """A new command type run on the engine thread; ``handler(cmd)`` returns the replies."""
        self.handlers[msg_type] = handler

    def register_side(self, msg_type: type, handler: Callable[[Any], list]) -> None:
        """A command type that touches no engine state, run on the worker's side threads (and on the
        engine thread should it arrive there)."""
        self.side_handlers[msg_type] = handler
        self.handlers[msg_type] = handler

    def run(self, cmd) -> list:
        if self.ahead is not None and not (type(cmd) is ExecuteMove and cmd.move_id == self.ahead.move_id):
            self.drop_ahead(f"{type(cmd).__name__} {command_ref(cmd)} came before its command")
        return self.handlers[type(cmd)](cmd)

    # ------------------------------------------------------------ early start
    def start_ahead(self, cmd: ExecuteMove) -> bool:
        """Begin the copies of a command that has not come yet (it rode on a CommandAhead; its
        MoveRequested is committing). Nothing is visible before the command itself comes and
        ``execute`` finishes the move; until then at most one move is begun this way. True: begun
        (the engine can, the route is device <-> host, and the move would not be refused)."""
        begin = getattr(self.engine, "begin_ahead", None)
        t0 = time.time_ns()
        if self.ahead is not None or begin is None or not begin(cmd):
            return False
        self.ahead, self.ahead_ns = cmd, t0
        return True

    def drop_ahead(self, why: str) -> None:
        """The early-started move's command did not come (or something else came first): its copies
        are waited for and its reservations undone; nothing was ever visible (``Engine.abandon``)."""
        if self.ahead is not None:
            cmd, self.ahead = self.ahead, None
            self.engine.abandon(cmd.move_id, why)

    def execute(self, cmd: ExecuteMove) -> list:
        ahead = self.ahead is not None and self.ahead == cmd
        if self.ahead is not None and not ahead:          # the same move_id, another command: never
            self.drop_ahead("its command differs from the one sent ahead")
        self.ahead = None
        if ahead:                             # begun on its CommandAhead: finish it now
            if self.faults.exec_delay_ms:
                time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.engine.wait(cmd.move_id)
        elif self.faults.exec_delay_ms and hasattr(self.engine, "submit"):
            # the pause falls in the middle of the move: destination reserved, copies begun, not committed
            ticket = self.engine.submit(cmd)
            time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.engine.wait(ticket)
        else:
            if self.faults.exec_delay_ms:
                time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.engine.execute(cmd)
        self.num_moves += 1
        if self.faults.crash_after_moves and self.num_moves == self.faults.crash_after_moves:
            log.warning("fault_injected_crash", fault="crash_after_moves", n=self.num_moves, move_id=cmd.move_id)
            os.kill(os.getpid(), signal.SIGKILL)
        return [outcome]

    def commit(self, cmd: CommitBlocks) -> list:
        try:
            return [self.engine.commit_blocks(cmd)]
        except self.expected_errors as e:
            return [CommandFailed(worker=self.worker, ref=cmd.request_id, error=type(e).__name__, detail=str(e))]

    def inventory(self, cmd: QueryInventory) -> list:
        tiers = ("device", "host", "disk")
        if hasattr(self.engine, "pool"):
            blocks = {t: sorted(self.engine.pool(t).blocks()) for t in tiers}
        else:
            blocks = {t: sorted(self.engine.where[t]) for t in tiers}
        return [Inventory(worker=self.worker, nonce=cmd.nonce, blocks=blocks, used_bytes=dict(self.engine.usage()))]

    def claim_disk(self, cmd: ClaimDisk) -> list:
        """Keep the offered files the ledger still has; delete the others (never any file made
        by this incarnation: only those offered)."""
        keep = set(cmd.keep)
        found = set(self.unclaimed_disk)
        drop = sorted(found - keep)
        freed = self.engine.disk_tier.free(drop) if drop else 0
        self.unclaimed_disk = []
        if drop:
            log.info("disk_files_dropped", worker=self.worker, blocks=len(drop), bytes=freed)
        return [DiskClaimed(worker=self.worker, kept=sorted(found & keep), dropped=drop, bytes_dropped=freed)]

    def release(self, cmd: ReleaseBlocks) -> list:
        try:
            return [self.engine.release(cmd)]
        except self.expected_errors as e:
            return [CommandFailed(worker=self.worker, ref=cmd.release_id, error=type(e).__name__, detail=str(e))]


class WorkerRecord:
    """What this incarnation did, by move_id. Shared by the I/O thread and, when the worker has an
    engine lane, the engine thread: every method takes ``lock``."""

    NEW, DUPLICATE, TOMBSTONED, RUNNING = "new", "duplicate", "tombstoned", "running"

    def __init__(self, worker: int):
        self.worker = worker
        self.lock = threading.Lock()
        self.outcomes: dict[str, Outcome] = {}     # for QueryMoves
        self.replies: dict[str, list] = {}          # what was (or would have been) sent, for duplicates
        self.running: set[str] = set()
        self.tombstones: set[str] = set()

    def claim(self, ref: str) -> tuple[str, list | None]:
        """A command arrived: run it (NEW, now counted running), send its replies again
        (DUPLICATE, with them), refuse it (TOMBSTONED: promised never to run) or drop it (RUNNING)."""
        with self.lock:
            if ref in self.replies:
                return self.DUPLICATE, self.replies[ref]
            if ref in self.tombstones:
                return self.TOMBSTONED, None
            if ref in self.running:
                return self.RUNNING, None
            self.running.add(ref)
            return self.NEW, None

    def note(self, ref: str, replies: list, now_ns: int) -> None:
        with self.lock:
            self._note(ref, replies, now_ns)

    def _note(self, ref: str, replies: list, now_ns: int) -> None:
        self.running.discard(ref)
        self.replies[ref] = replies
        for r in replies:
            if isinstance(r, (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected)):
                self.outcomes[r.move_id] = r
            elif isinstance(r, BlocksReleased):
                self.outcomes[ref] = ev.MoveAcked(move_id=ref, worker=self.worker, bytes_moved=0,
                                                  bytes_freed_src=r.bytes_freed, checksum_ok=True,
                                                  started_ns=now_ns, finished_ns=now_ns)
            elif isinstance(r, CommandFailed) and ref.startswith("m-"):
                self.outcomes[ref] = ev.MoveFailed(move_id=ref, worker=self.worker,
                                                   error=f"{r.error}: {r.detail}", bytes_moved=None)

    def report(self, move_ids: list[str]) -> MovesReport:
        """Outcomes we have; ids never seen become tombstones; ids still running are left out
        (their outcome is sent when they finish)."""
        outcomes, unknown = [], []
        with self.lock:
            self._report(move_ids, outcomes, unknown)
        return MovesReport(worker=self.worker, outcomes=outcomes, unknown=unknown)

    def _report(self, move_ids: list[str], outcomes: list, unknown: list) -> None:
        for mid in move_ids:
            o = self.outcomes.get(mid)
            if o is not None:
                outcomes.append(o)
            elif mid not in self.running:
                unknown.append(mid)
                self.tombstones.add(mid)

    def refusal(self, cmd) -> list:
        """The answer to a command whose id was promised never to run."""
        if isinstance(cmd, ExecuteMove):
            return [ev.MoveRejected(move_id=cmd.move_id, worker=self.worker, asked_bytes=0, blocks=list(cmd.blocks),
                                    reason="reported unknown to a QueryMoves earlier; never executed")]
        return [CommandFailed(worker=self.worker, ref=cmd.release_id, error="abandoned",
                              detail="reported unknown to a QueryMoves earlier; never executed")]


class NoCopyError(Exception):
    """The no-copy engine's "no" (it imports nothing of the real data plane, so not a DataPlaneError)."""


class NoCopyEngine:
    """Keeps the block tables and answers like the real engine, moving no bytes at all.

    For measuring the control plane alone (``bench/control.py --engine nocopy``); never a default.
    It validates like the engine (blocks on src, none on dst, room) so acks stay truthful about
    placement; ``bytes_moved`` is what a copy would have moved.
    """

    def __init__(self, block_bytes: int, capacities: dict[str, int], worker: int = 0, device: str = "cpu"):
        self.block_bytes = block_bytes
        self.caps = dict(capacities)
        self.worker = worker
        self.device = device
        self.where: dict[str, set[int]] = {t: set() for t in capacities}
        self._outcomes: dict[str, Outcome] = {}

    def capacities(self) -> dict[str, int]:
        return dict(self.caps)

    def usage(self) -> dict[str, int]:
        return {t: len(b) * self.block_bytes for t, b in self.where.items()}

    def _room(self, tier: str, n: int) -> int:
        return self.caps[tier] // self.block_bytes - len(self.where[tier]) - n

    def execute(self, cmd: ExecuteMove) -> Outcome:
        if cmd.move_id in self._outcomes:
            return self._outcomes[cmd.move_id]
        src, dst, ids = self.where[cmd.src], self.where[cmd.dst], cmd.blocks
        nbytes = len(ids) * self.block_bytes
        bad = [b for b in ids if b not in src or b in dst]
        if bad or self._room(cmd.dst, len(ids)) < 0:
            out = ev.MoveRejected(move_id=cmd.move_id, worker=self.worker, asked_bytes=nbytes, blocks=bad,
                                  reason="blocks not on src or already on dst" if bad else "no room",
                                  available_bytes=max(0, self._room(cmd.dst, 0)) * self.block_bytes)
        else:
            t0 = time.time_ns()
            dst.update(ids)
            if not cmd.keep_source:
                src.difference_update(ids)
            out = ev.MoveAcked(move_id=cmd.move_id, worker=self.worker, bytes_moved=nbytes,
                               bytes_freed_src=0 if cmd.keep_source else nbytes, checksum_ok=True,
                               started_ns=t0, finished_ns=time.time_ns())
        self._outcomes[cmd.move_id] = out
        return out

    def commit_blocks(self, cmd: CommitBlocks) -> BlocksWritten:
        tier = self.where[cmd.tier]
        if any(b in tier for b in cmd.blocks) or self._room(cmd.tier, len(cmd.blocks)) < 0:
            raise NoCopyError(f"cannot commit {len(cmd.blocks)} blocks on {cmd.tier}")
        tier.update(cmd.blocks)
        return BlocksWritten(request_id=cmd.request_id, worker=self.worker, tier=cmd.tier, blocks=list(cmd.blocks),
                             bytes=len(cmd.blocks) * self.block_bytes, keys=[""] * len(cmd.blocks))

    def release(self, cmd: ReleaseBlocks) -> BlocksReleased:
        tier = self.where[cmd.tier]
        missing = [b for b in cmd.blocks if b not in tier]
        if missing:
            raise NoCopyError(f"not resident on {cmd.tier}: blocks {missing[:16]}")
        tier.difference_update(cmd.blocks)
        return BlocksReleased(release_id=cmd.release_id, worker=self.worker, tier=cmd.tier, blocks=list(cmd.blocks),
                              bytes_freed=len(cmd.blocks) * self.block_bytes)

    def check_integrity(self) -> None:
        for t, b in self.where.items():
            if len(b) * self.block_bytes > self.caps[t]:
                raise NoCopyError(f"{t}: {len(b)} blocks exceed capacity {self.caps[t]}")

    def close(self) -> None:
        pass
