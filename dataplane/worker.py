"""The worker's core: what it does with each command, and the record of what it did. No sockets.

``WorkerCore.run(cmd)`` runs on the worker's one device thread (the only thread that touches the
mover and the model) and returns the replies to send. ``WorkerRecord`` is shared by the threads
that own the sockets: every outcome by move_id (moves and releases), the commands still running,
and the ids it promised never to run (answered "unknown" to a ``QueryMoves``: the control process
then records them abandoned, so a stale command still in a pipe must be refused, never executed).

New message types (the serving path's ``Generate`` ...) join by ``WorkerCore.register``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from residency.dataplane.faults import WorkerFaults
from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, ClaimDisk, CommandFailed, ErrorReply, CommitBlocks, DiskClaimed, ExecuteMove, Inventory,
    MovesReport, PoolRebound, QueryInventory, ReleaseBlocks, ResizePool,
)

log = structlog.get_logger("dataplane.worker")
Outcome = ev.MoveAcked | ev.MoveFailed | ev.MoveRejected
# replies that are a command's outcome (encoded once, and held or dropped by the reply faults)
OUTCOMES = (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected, BlocksReleased)


def command_ref(cmd) -> str | None:
    """The id a command is known by: its move_id, release_id or request_id."""
    return getattr(cmd, "move_id", None) or getattr(cmd, "release_id", None) or getattr(cmd, "request_id", None)


def run_guarded(cmd, run: Callable[[Any], list]) -> list:
    """``run(cmd)``'s replies; a handler that raises is answered by name (a bug in one must not
    kill the worker)."""
    try:
        return run(cmd)
    except Exception as e:  # noqa: BLE001 - answered, logged once here
        log.error("command_raised", type=type(cmd).__name__, ref=command_ref(cmd), error=repr(e), exc_info=True)
        return [ErrorReply(error="command_raised", detail=f"{type(cmd).__name__} {command_ref(cmd)}: {e!r}")]


def step_guarded(step: Callable[[], list]) -> list:
    """One step of background work (serving): its replies, or the error it raised, named."""
    try:
        return step() or []
    except Exception as e:  # noqa: BLE001 - a bug in the serving loop must not kill the worker
        log.error("background_step_raised", error=repr(e), exc_info=True)
        return [ErrorReply(error="background_step_raised", detail=repr(e))]


class WorkerCore:
    """Runs commands against the mover (``mover``). Device thread only."""

    def __init__(self, mover, worker: int, faults: WorkerFaults | None = None,
                 expected_errors: tuple[type[BaseException], ...] = ()):
        self.mover = mover
        # the mover's "no" (no room, not resident, busy): answered as CommandFailed, named
        self.expected_errors = expected_errors
        self.worker = worker
        self.faults = faults or WorkerFaults()
        self.handlers: dict[type, Callable[[Any], list]] = {
            ExecuteMove: self.execute, CommitBlocks: self.commit, ReleaseBlocks: self.release,
            QueryInventory: self.inventory, ClaimDisk: self.claim_disk, ResizePool: self.resize_pool,
        }
        # the dial: ResizePool resizes the device pool and rebinds its readers (dataplane/rebind.py);
        # a mover without a resizable pool (the benches' no-copy mover) answers it with an error
        self.rebinder = None
        if hasattr(getattr(mover, "device_pool", None), "readers"):
            from residency.dataplane.rebind import Rebinder  # noqa: PLC0415 - torch, only for a real mover
            self.rebinder = Rebinder(mover, worker, miss_stamp=self.faults.take_miss_stamp)
        # files of an earlier incarnation the mover found on its disk and verified (--keep-disk),
        # offered in Hello until the control's ClaimDisk says which to keep
        report = getattr(mover, "disk_report", None)
        self.unclaimed_disk: list[int] = sorted(report.indexed) if report is not None else []
        if report is not None and (report.indexed or report.quarantined):
            log.info("disk_rebuilt", worker=worker, found=len(report.indexed), quarantined=report.quarantined,
                     removed_temporaries=len(report.removed_temporaries))
        # Set by dataplane.serving_worker.attach: the work the device thread does while no command
        # waits (has_work, step -> replies), and the messages that follow every Hello.
        self.background: tuple[Callable[[], bool], Callable[[], list]] | None = None
        self.hello_extras: Callable[[], list] = lambda: []
        # ... and (steps completed, sequences held) of that work, read by the I/O thread for its Pong
        self.progress: Callable[[], tuple[int, int]] | None = None
        # commands that read no mover state (Tokenize): a worker process runs them on its side
        # threads (dataplane/side.py), so a long one never holds up the device thread's steps
        self.side_handlers: dict[type, Callable[[Any], list]] = {}
        # an early-started move (``start_ahead``): its command, and when it began (wall ns)
        self.ahead: ExecuteMove | None = None
        self.ahead_ns = 0
        # the memory books (dataplane/memory_books.py): sizing, weights, pinned grants, the probe
        self.books = None
        # restores whose finish a serving worker keeps for later, so the Generate that follows can
        # read their layers as they land (dataplane/restore_pipeline.py; set by serving_worker.attach),
        # and whether the command running now may be kept so (the device thread's lane commands: their
        # outcomes leave from the device thread, which sends a kept one when it is settled)
        self.restores = None
        self.may_keep = False
        # what else holds pinned memory and must give it back at stop (the weights slab), before the mover
        self.closers: list[Callable[[], None]] = []
        # a rank of a tensor-parallel group: its Hello's group, rank and ranks (dataplane/group.py)
        self.group_fields: dict = {}

    def close(self) -> None:
        """The worker stops: its other pinned holders, then the mover (moves finished first)."""
        while self.closers:
            self.closers.pop()()
        self.mover.close()

    def register(self, msg_type: type, handler: Callable[[Any], list]) -> None:
        """A new command type run on the device thread; ``handler(cmd)`` returns the replies."""
        self.handlers[msg_type] = handler

    def register_side(self, msg_type: type, handler: Callable[[Any], list]) -> None:
        """A command type that touches no mover state, run on the worker's side threads (and on the
        device thread should it arrive there)."""
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
        (the mover can, the route is device <-> host, and the move would not be refused)."""
        begin = getattr(self.mover, "begin_ahead", None)
        t0 = time.time_ns()
        if self.ahead is not None or begin is None or not begin(cmd):
            return False
        self.ahead, self.ahead_ns = cmd, t0
        return True

    def drop_ahead(self, why: str) -> None:
        """The early-started move's command did not come (or something else came first): its copies
        are waited for and its reservations undone; nothing was ever visible (``Mover.abandon``)."""
        if self.ahead is not None:
            cmd, self.ahead = self.ahead, None
            self.mover.abandon(cmd.move_id, why)

    def execute(self, cmd: ExecuteMove) -> list:
        ahead = self.ahead is not None and self.ahead == cmd
        if self.ahead is not None and not ahead:          # the same move_id, another command: never
            self.drop_ahead("its command differs from the one sent ahead")
        self.ahead = None
        if self.may_keep and self.restores is not None and not self.faults.exec_delay_ms \
                and self.restores.can_keep(cmd):
            self.restores.keep(cmd, begun=ahead)     # its outcome leaves when it is settled
            return []
        if ahead:                             # begun on its CommandAhead: finish it now
            if self.faults.exec_delay_ms:
                time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.mover.wait(cmd.move_id)
        elif self.faults.exec_delay_ms and hasattr(self.mover, "submit"):
            # the pause falls in the middle of the move: destination reserved, copies begun, not committed
            ticket = self.mover.submit(cmd)
            time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.mover.wait(ticket)
        else:
            if self.faults.exec_delay_ms:
                time.sleep(self.faults.exec_delay_ms / 1000)
            outcome = self.mover.execute(cmd)
        return [outcome]

    def resize_pool(self, cmd: ResizePool) -> list:
        """Resize the device pool and rebind its readers: one PoolRebound (``error``: nothing changed)."""
        if self.rebinder is None:
            return [PoolRebound(rebind_id=cmd.rebind_id, worker=self.worker, tier=cmd.tier, from_gen=0,
                                to_gen=cmd.to_gen, from_slots=0, to_slots=0, from_bytes=0, to_bytes=0,
                                started_ns=time.time_ns(), finished_ns=time.time_ns(),
                                error="this worker's mover has no resizable device pool")]
        return self.rebinder.handle(cmd)

    def pool_status(self) -> tuple[int, list[str]]:
        """(the device pool's generation, its readers), for Hello and ServingReady."""
        return self.rebinder.status() if self.rebinder is not None else (0, [])

    def commit(self, cmd: CommitBlocks) -> list:
        try:
            return [self.mover.commit_blocks(cmd)]
        except self.expected_errors as e:
            return [CommandFailed(worker=self.worker, ref=cmd.request_id, error=type(e).__name__, detail=str(e))]

    def inventory(self, cmd: QueryInventory) -> list:
        blocks = {t: sorted(self.mover.pool(t).blocks()) for t in ("device", "host", "disk")}
        return [Inventory(worker=self.worker, nonce=cmd.nonce, blocks=blocks, used_bytes=dict(self.mover.usage()))]

    def claim_disk(self, cmd: ClaimDisk) -> list:
        """Keep the offered files the ledger still has; delete the others (never any file made
        by this incarnation: only those offered)."""
        keep = set(cmd.keep)
        found = set(self.unclaimed_disk)
        drop = sorted(found - keep)
        freed = self.mover.disk_tier.free(drop) if drop else 0
        self.unclaimed_disk = []
        if drop:
            log.info("disk_files_dropped", worker=self.worker, blocks=len(drop), bytes=freed)
        return [DiskClaimed(worker=self.worker, kept=sorted(found & keep), dropped=drop, bytes_dropped=freed)]

    def release(self, cmd: ReleaseBlocks) -> list:
        try:
            return [self.mover.release(cmd)]
        except self.expected_errors as e:
            return [CommandFailed(worker=self.worker, ref=cmd.release_id, error=type(e).__name__, detail=str(e))]


class WorkerRecord:
    """What this incarnation did, by move_id. Shared by the I/O thread and the device thread (each
    answers the commands of its own socket): every method takes ``lock``."""

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
