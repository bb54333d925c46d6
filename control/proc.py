"""ControlProc: the control process's shell around the pure core (fold, policies, moves, watchdog).

One thread owns the sockets, the live state and the ledger writer's producer side:

    recover()                          replay the ledger; adopt or lose the workers it names
    while running:
        poll()                         workers' replies, operators' asks, calls posted by other threads
        commits()                      write-ahead: send each command whose MoveRequested committed,
                                       answer each asker whose outcome committed
        tick(now)                      heartbeats, deadlines, policies, checkpoints

Other threads (the HTTP API, ``residency serve``'s supervisor) use only the thread-safe methods:
``submit(ask) -> Future``, ``call(fn) -> Future``, ``worker_exited``, ``health``, ``stop``.

Every event is folded into the live state at the moment it is handed to the group-commit writer,
with the seq it will get: this process is the ledger's single writer, so the seq is known, and each
commit checks it (``LedgerDiverged`` if not). Live state therefore always includes the events that
are still committing, which is what decisions must see (an in-flight move's bytes are booked at
once), while nothing leaves the process before its event is committed.
"""
from __future__ import annotations

import collections
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgspec
import structlog
import zmq

from events import catalog as ev
from events.commands import (
    AskAnswered, AskCommitBlocks, AskMove, AskReleaseBlocks, AskSetBudget, AskStatus, BlocksReleased,
    BlocksWritten, CommandFailed, CommitBlocks, ErrorReply, Hello, MovesReport, MoveTimed, Ping, Pong,
    QueryMoves, Shutdown, StatusReport,
)
from events.envelope import Envelope, Recorded
from control import budget, moves, recovery, watchdog
from control.fold import fold
from control.policy import PolicyConfig, RefusalMemo, plan, release
from control.policy.recency import Recency
from control.state import State, encode_state, state_hash
from control.transport import (
    INVALID_ASK, UNKNOWN_WORKER, WORKER_LOST, WORKER_MISMATCH, AskServer, TransportError, WorkerRouter,
    WorkerUnreachable, parse_worker_identity, worker_identity,
)

log = structlog.get_logger("control.proc")
MS, S = 1_000_000, 1_000_000_000
PRODUCER = recovery.PRODUCER
SERVER_VERSION = "0.1.0"


class ControlConfig(msgspec.Struct, kw_only=True):
    worker_endpoint: str
    ask_endpoint: str | None = None
    expected_workers: list[int] | None = None  # None: any worker that says Hello is taken
    ping_interval_s: float = 0.25
    heartbeat_missed_s: float = 1.5
    worker_lost_s: float = 5.0
    adopt_grace_s: float = 3.0            # after a crash: how long workers have to come back
    requery_interval_s: float = 1.0       # ask workers again about stranded moves (late acks)
    deadline_grace_s: float = 1.0         # past a move's deadline, wait this long for the worker's own
                                          # verdict (it refuses to start a move past its deadline)
    policy_interval_s: float = 0.1
    checkpoint_every_events: int = 10_000
    checkpoint_every_s: float = 5.0
    snapshot_every_events: int = 100_000
    commit_max_batch: int = 1000
    commit_max_delay_s: float = 0.0       # 0: commit at once; batches form while a commit runs
    commit_inline: bool = True            # commit on the loop thread when no commit is in flight
    max_queue: int = 100_000
    durability: str = "normal"
    stall_after_s: float = 1.0            # health: a loop or a commit stuck this long is unhealthy
    shutdown_grace_s: float = 2.0
    release_on_stop: bool = True          # a clean stop frees every copy by the book
    config_digest: str = ""
    faults: str = ""                      # ControlFaults spec; off unless set (tests only)
    trace_moves: int = 0                  # keep wall-clock phase marks of the last N moves (bench)
    moves: moves.MoveConfig = msgspec.field(default_factory=moves.MoveConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)


class ControlError(Exception):
    """Root of the control process's own errors."""


class LedgerDiverged(ControlError):
    """A committed seq differs from the one the live state folded: another writer touched the ledger."""


class ControlFaults:
    """Fault hooks for the fault tests, OFF unless named (``faults`` or RESIDENCY_CONTROL_FAULTS):

        crash_after_requested=N    SIGKILL self when the Nth command is about to be sent
                                   (its MoveRequested is committed; the worker never sees it)
        crash_after_dispatch=N     SIGKILL self 50 ms after sending the Nth command (before its ack)
        crash_before_ack_append=N  SIGKILL self on receiving the Nth move outcome, before recording it
        crash_after_events=N       SIGKILL self right after handing the Nth event to the writer
    """

    NAMES = ("crash_after_requested", "crash_after_dispatch", "crash_before_ack_append", "crash_after_events")

    def __init__(self, spec: str = ""):
        self.at: dict[str, int] = {}
        self.count: dict[str, int] = collections.Counter()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name not in self.NAMES:
                raise ValueError(f"unknown control fault {name!r} (known: {', '.join(self.NAMES)})")
            self.at[name] = int(value)

    def hit(self, name: str, delay_s: float = 0.0) -> None:
        if name not in self.at:
            return
        self.count[name] += 1
        if self.count[name] == self.at[name]:
            log.warning("fault_injected_crash", fault=name, n=self.at[name])
            if delay_s:
                time.sleep(delay_s)
            os.kill(os.getpid(), signal.SIGKILL)


class Recorder:
    """The producer side of the ledger: fold now, commit at the end of the loop's iteration.

        record(event)   folds it into the live state with the seq it will get; buffers it
        flush()         writer idle (nothing of ours committing): append the buffer here, in one
                        transaction, now -- the lowest latency for a lone move;
                        otherwise hand it to the group-commit writer's thread, whose next batch
                        takes it -- commits overlap with the loop's own work under load
        advance()       settle the writer's futures in order; the highest committed seq

    NOTE: both paths keep seq order: the inline path is taken only when no writer future of ours
    is unresolved, and only this thread records.
    """

    def __init__(self, store, writer, state: State, recency: Recency, epoch: int, faults: ControlFaults,
                 durability: str = "normal", inline_max: int = 1000):
        self.store = store
        self.writer = writer
        self.state = state
        self.recency = recency
        self.epoch = epoch
        self.faults = faults
        self.durability = durability
        self.inline_max = inline_max
        self.producer_seq = 0
        self.next_seq = state.last_seq + 1
        self.committed = state.last_seq
        self._buffer: list[tuple[Envelope, ev.Event]] = []
        self._pending: collections.deque[tuple[int, Future, int]] = collections.deque()
        self._armed: Future | None = None
        self._inline_since = 0
        self.num_inline = self.num_handed = 0

    def record(self, event: ev.Event, correlation: str | None = None, causation: str | None = None) -> int:
        ts = time.time_ns()
        self.producer_seq += 1
        seq = self.next_seq
        self.next_seq += 1
        env = Envelope(producer=PRODUCER, epoch=self.epoch, producer_seq=self.producer_seq, ts_ns=ts,
                       correlation_id=correlation, causation=causation, seq=seq)
        self.recency.observe(self.state, event, ts)
        fold(self.state, Recorded(env, event))
        self._buffer.append((env, event))
        self.faults.hit("crash_after_events")
        return seq

    def flush(self) -> None:
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        if not self._pending and len(batch) <= self.inline_max:
            self._inline_since = time.monotonic_ns()
            try:
                seqs = self.store.append(batch, durability=self.durability)
            finally:
                self._inline_since = 0
            if seqs[0] != batch[0][0].seq or seqs[-1] != batch[-1][0].seq:
                raise LedgerDiverged(f"events folded as seqs {batch[0][0].seq}..{batch[-1][0].seq} were committed "
                                     f"as {seqs[0]}..{seqs[-1]}: another writer appended to this ledger")
            self.committed = seqs[-1]
            self.num_inline += 1
            return
        now = time.monotonic_ns()
        for env, event in batch:
            # NOTE: blocks while the writer's queue is full (back-pressure: its log line and
            # stats say so, and health() reports the loop stalled).
            self._pending.append((env.seq, self.writer.submit(env, event), now))
        self.num_handed += 1

    def advance(self) -> int:
        """Settle committed futures in order; raises the ledger's error or LedgerDiverged."""
        q = self._pending
        while q and q[0][1].done():
            seq, fut, _ = q.popleft()
            got = fut.result()
            if got != seq:
                raise LedgerDiverged(f"event folded as seq {seq} was committed as seq {got}: "
                                     "another writer appended to this ledger")
            self.committed = seq
        return self.committed

    def arm(self, wake: Callable[[], None]) -> None:
        """Wake the loop when everything handed over so far has committed (commits are in order)."""
        if self._pending and self._pending[-1][1] is not self._armed:
            self._armed = self._pending[-1][1]
            self._armed.add_done_callback(lambda _f: wake())

    def lag_ns(self, now_ns: int) -> int:
        """How long the oldest uncommitted event of ours has waited (inline commit included)."""
        oldest = [t for t in (self._inline_since, self._pending[0][2] if self._pending else 0) if t]
        return now_ns - min(oldest) if oldest else 0

    @property
    def uncommitted(self) -> int:
        return len(self._pending) + len(self._buffer)


class MoveTraces:
    """Wall-clock marks (``time.time_ns``, the clock of a worker's ``started_ns``/``finished_ns``)
    of the phases of the last ``keep`` moves: where a move's time goes between the asker and the
    worker (bench/control.py prints the breakdown). Off (keep=0) unless configured.

        asked      the loop took the ask          requested  its MoveRequested folded and buffered
        committed  that event committed (sent)    sent       the command handed to ZMQ
        received   the outcome read off the socket (before decoding)
        decoded    the outcome decoded, handler entered
        recorded   its terminal event folded and buffered
        answered   that event committed, the asker answered
    """

    def __init__(self, keep: int = 0):
        self.keep = keep
        self.by_move: dict[str, dict[str, int]] = {}

    def mark(self, move_id: str, phase: str, t_ns: int | None = None) -> None:
        if not self.keep:
            return
        marks = self.by_move.get(move_id)
        if marks is None:
            if len(self.by_move) >= self.keep:
                del self.by_move[next(iter(self.by_move))]
            marks = self.by_move[move_id] = {}
        marks[phase] = time.time_ns() if t_ns is None else t_ns


class WorkerLink:
    __slots__ = ("worker", "identity", "epoch", "last_heard_ns", "missed", "asked", "last_query_ns", "device")

    def __init__(self, worker: int, identity: bytes, epoch: int, device: str, now_ns: int):
        self.worker, self.identity, self.epoch, self.device = worker, identity, epoch, device
        self.last_heard_ns = now_ns
        self.missed = False
        self.asked: set[str] = set()
        self.last_query_ns = 0


class Health(msgspec.Struct, kw_only=True):
    healthy: bool
    problems: list[str]
    metrics: dict[str, float]


class ControlProc:
    def __init__(self, store, config: ControlConfig, writer_factory: Callable | None = None,
                 ctx: zmq.Context | None = None):
        self.store = store
        self.cfg = config
        self.faults = ControlFaults(config.faults or os.environ.get("RESIDENCY_CONTROL_FAULTS", ""))
        self._ctx = ctx or zmq.Context.instance()
        self._writer_factory = writer_factory or self._default_writer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_reason: str | None = None
        self._fatal: BaseException | None = None
        self._stopped = threading.Event()
        self._beat_ns = time.monotonic_ns()
        self._handlers: dict[type, Callable] = {
            Hello: self._on_hello, Pong: self._on_pong, ev.MoveAcked: self._on_outcome,
            ev.MoveFailed: self._on_outcome, ev.MoveRejected: self._on_outcome, BlocksReleased: self._on_released,
            BlocksWritten: self._on_written, MovesReport: self._on_report, CommandFailed: self._on_command_failed,
            ErrorReply: self._on_worker_error, MoveTimed: self._on_timed,
        }
        self._unhandled_logged: set[type] = set()
        self._listeners: list[Callable[[int, ev.Event], None]] = []
        # Blocks the serving path is using right now (worker -> ids): policies never move them.
        self.blocks_in_use: Callable[[], dict[int, set[int]]] = lambda: {}
        self.metrics: collections.Counter = collections.Counter()
        self.traces = MoveTraces(config.trace_moves)
        # set by _recover()
        self.state = State()
        self.recency = Recency()
        self.epoch = 0
        self.recovered: recovery.Recovered | None = None

    # ================================================================== thread-safe API
    def start(self, timeout_s: float = 60.0) -> "ControlProc":
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._fatal is not None:
            raise ControlError(f"control process did not start: {self._fatal!r}") from self._fatal
        return self

    def submit(self, ask, asker: str = "api") -> "Future":
        """Hand an ask (AskMove, AskCommitBlocks, AskReleaseBlocks, AskSetBudget, AskStatus) to the
        loop; the future resolves to its AskAnswered / StatusReport once the outcome is committed."""
        fut: Future = Future()
        self._post(("ask", ask, asker, fut.set_result))
        return fut

    def submit_many(self, asks, asker: str = "api") -> list["Future"]:
        """``submit`` for many asks at once: one wake of the loop, and their events share commits."""
        futs = [Future() for _ in asks]
        for ask, fut in zip(asks, futs):
            self._inbox.put(("ask", ask, asker, fut.set_result))
        self._wake()
        return futs

    def call(self, fn: Callable[["ControlProc"], Any]) -> "Future":
        """Run ``fn(self)`` on the loop's thread (the one place it may touch state and sockets)."""
        fut: Future = Future()
        self._post(("call", fn, fut))
        return fut

    def worker_exited(self, worker: int, epoch: int, returncode: int | None) -> None:
        """The supervisor saw the process of ``worker`` incarnation ``epoch`` exit."""
        self._post(("exited", worker, epoch, returncode))

    def stop(self, reason: str = "stopped", timeout_s: float = 30.0) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def fatal(self) -> BaseException | None:
        return self._fatal

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> Health:
        """Safe from any thread, and honest when the loop itself is stuck (it reads only clocks and
        counters the loop keeps moving): a stalled loop or commit is never reported healthy."""
        now = time.monotonic_ns()
        problems: list[str] = []
        loop_lag = now - self._beat_ns
        rec = getattr(self, "_recorder", None)
        commit_lag = rec.lag_ns(now) if rec else 0
        stats = self._writer.stats() if getattr(self, "_writer", None) else {}
        stall = int(self.cfg.stall_after_s * S)
        if self._fatal is not None:
            problems.append(f"control loop failed: {self._fatal}")
        elif not self.running:
            problems.append("control loop not running")
        if loop_lag > stall:
            problems.append(f"control loop stalled for {loop_lag // MS} ms")
        if commit_lag > stall:
            problems.append(f"ledger commit lagging {commit_lag // MS} ms (queue {stats.get('queue_depth', 0)})")
        if stats.get("queue_depth", 0) >= self.cfg.max_queue:
            problems.append(f"ledger back-pressure: queue full ({stats['queue_depth']})")
        metrics = {k: float(v) for k, v in dict(self.metrics).items()}
        metrics.update({f"ledger_{k}": float(v) for k, v in stats.items()})
        metrics.update(loop_lag_ms=loop_lag / MS, commit_lag_ms=commit_lag / MS)
        return Health(healthy=not problems, problems=problems, metrics=metrics)

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake()

    def _wake(self) -> None:
        # NOTE: once closed, the fd number may belong to another file of this process: never write it.
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop wakes anyway

    # ================================================================== the loop
    def _run(self) -> None:
        try:
            self._open()
            self._recover()
            self._ready.set()
            while self._stop_reason is None:
                self._poll()
                self._recorder.flush()
                self._commits()
                # NOTE: after the commits, so a checkpoint's hash or a policy's scan never sits
                # between an outcome and its answer; what the tick records commits right here.
                self._tick()
                self._recorder.flush()
                self._commits()
            self._shutdown(self._stop_reason)
        except BaseException as e:  # noqa: BLE001 - reported through health/fatal and the log, once
            self._fatal = e
            log.error("control_loop_failed", error=str(e), error_type=type(e).__name__, exc_info=True)
        finally:
            self._ready.set()
            self._close()
            self._stopped.set()

    def _default_writer(self, store):
        from ledger.writer import GroupCommitWriter
        return GroupCommitWriter(store, max_batch=self.cfg.commit_max_batch, max_delay_s=self.cfg.commit_max_delay_s,
                                 max_queue=self.cfg.max_queue, durability=self.cfg.durability)

    def _open(self) -> None:
        self._router = WorkerRouter(self._ctx, self.cfg.worker_endpoint)
        self._asks = AskServer(self._ctx, self.cfg.ask_endpoint) if self.cfg.ask_endpoint else None
        self._poller = zmq.Poller()
        self._poller.register(self._router.sock, zmq.POLLIN)
        if self._asks:
            self._poller.register(self._asks.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _close(self) -> None:
        for name in ("_router", "_asks"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        w = getattr(self, "_writer", None)
        if w is not None:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001
                log.warning("ledger_writer_close_failed", error=str(e))
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_r = self._wake_w = -1
        for fd in (wake_r, wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _recover(self) -> None:
        t0 = time.monotonic()
        rec = recovery.replay(self.store)
        self.recovered = rec
        self.state, self.recency, self.epoch, self.roster = rec.state, rec.recency, rec.epoch, dict(rec.roster)
        self._writer = self._writer_factory(self.store)
        self._recorder = Recorder(self.store, self._writer, self.state, self.recency, self.epoch, self.faults,
                                  self.cfg.durability, inline_max=1000 if self.cfg.commit_inline else 0)
        self.book = moves.MoveBook()
        self.busy = moves.BusyIndex(self.state)
        # stranded moves their worker has answered for with a failure (or "never received"):
        # they will never land, so they hold neither blocks nor room. The ledger has no event for
        # that answer (only MoveLateAcked resolves a stranding), so they stay listed stranded there.
        self.answered_stranded: set[str] = set()
        self.memo = RefusalMemo()
        self._links: dict[bytes, WorkerLink] = {}
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
        self._next = {"ping": now, "policy": now, "watchdog": now, "requery": now}
        self._next_park = now
        self._last_ckpt = (self._recorder.producer_seq, now)
        self._last_snapshot_seq = rec.from_snapshot
        # Workers the ledger says are serving: after a crash they get a grace to come back.
        alive = [w for w, ws in self.state.workers.items() if ws.alive]
        self._adopting: dict[int, int] = {w: now + int(self.cfg.adopt_grace_s * S) for w in alive} if rec.crashed else {}
        self._record(ev.ServerStarted(version=SERVER_VERSION, config_digest=self.cfg.config_digest))
        self._recorder.flush()
        log.info("control_recovered", last_seq=rec.last_seq, replayed=rec.num_replayed, snapshot=rec.from_snapshot,
                 epoch=self.epoch, crashed=rec.crashed, in_flight=len(self.state.inflight),
                 stranded=len(self.state.stranded), adopting=sorted(self._adopting),
                 seconds=round(time.monotonic() - t0, 3))

    def _poll(self) -> None:
        self._beat_ns = now = time.monotonic_ns()
        timeout_ms = max(0, min(self._next.values()) - now) // MS
        self._recorder.arm(self._wake)
        events = dict(self._poller.poll(min(timeout_ms, 50)))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        self._drain_inbox()
        if self._router.sock in events:
            for _ in range(1024):
                if not self._recv_worker():
                    break
        if self._asks is not None and self._asks.sock in events:
            for _ in range(64):
                if not self._recv_ask():
                    break

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "ask":
                _, ask, asker, reply = item
                self._on_ask_guarded(ask, asker, reply)
            elif kind == "call":
                _, fn, fut = item
                try:
                    fut.set_result(fn(self))
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    fut.set_exception(e)
            elif kind == "exited":
                _, worker, epoch, rc = item
                if self.roster.get(worker) == epoch:    # not an incarnation already replaced
                    self._lose(worker, f"worker process exited with code {rc}")

    def _commits(self) -> None:
        committed = self._recorder.advance()
        for req in self.book.committed(committed):
            self._dispatch(req)
        answers = self._answers
        while answers and answers[0][0] <= committed:
            _, waiter = answers.popleft()
            self._answer(waiter)
        if self._snapshot_pending and self._snapshot_pending[0] <= committed:
            through, data, digest = self._snapshot_pending
            self._snapshot_pending = None
            self.store.save_snapshot(through, data, digest)
            self._last_snapshot_seq = through
            log.info("snapshot_saved", through_seq=through, bytes=len(data))

    def _tick(self) -> None:
        now = time.monotonic_ns()
        nxt = self._next
        if now >= nxt["watchdog"]:
            nxt["watchdog"] = now + 10 * MS
            self._watch_deadlines()
        if now >= nxt["ping"]:
            nxt["ping"] = now + int(self.cfg.ping_interval_s * S)
            self._heartbeats(now)
        if now >= nxt["requery"]:
            nxt["requery"] = now + int(self.cfg.requery_interval_s * S)
            self._requery(now)
        if now >= nxt["policy"]:
            nxt["policy"] = now + int(self.cfg.policy_interval_s * S)
            if not self._adopting:
                self._run_policies()
        pseq, at = self._last_ckpt
        if self._recorder.producer_seq > pseq and (
                self._recorder.producer_seq - pseq >= self.cfg.checkpoint_every_events
                or now - at >= int(self.cfg.checkpoint_every_s * S)):
            self._checkpoint(now)

    # ================================================================== recording
    def record(self, event: ev.Event, correlation: str | None = None, causation: str | None = None) -> int:
        """Fold ``event`` into the live state and queue it for the ledger; returns its seq.
        Loop thread only (handlers, ``call``). It is committed by the end of this loop iteration
        (or handed to the group-commit writer, when commits are already in flight)."""
        self.metrics[f"recorded_{type(event).__name__}"] += 1
        seq = self._recorder.record(event, correlation, causation)
        for listener in self._listeners:
            try:
                listener(seq, event)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the ledger's writer
                log.exception("listener_failed", listener=getattr(listener, "__qualname__", repr(listener)))
        return seq

    _record = record

    def add_listener(self, fn: Callable[[int, ev.Event], None]) -> None:
        """``fn(seq, event)`` on the loop thread after each event is folded (before its commit)."""
        self._listeners.append(fn)

    def _checkpoint(self, now: int) -> None:
        through = self.state.last_seq
        digest = state_hash(self.state)
        if through - self._last_snapshot_seq >= self.cfg.snapshot_every_events and self._snapshot_pending is None:
            self._snapshot_pending = (through, encode_state(self.state), digest)
        self._record(ev.StateCheckpoint(through_seq=through, state_hash=digest))
        self._last_ckpt = (self._recorder.producer_seq, now)
        self.recency.prune(self.state)

    # ================================================================== workers
    def _send(self, link: WorkerLink, msg) -> bool:
        try:
            self._router.send(link.identity, msg)
            return True
        except WorkerUnreachable as e:
            self.metrics["send_unreachable"] += 1
            log.warning("worker_unreachable", worker=link.worker, error=e.detail)
            return False

    def send_to_worker(self, worker: int, msg) -> bool:
        """Send any command to a joined worker (loop thread only; ``call`` from elsewhere)."""
        link = self._by_worker.get(worker)
        return link is not None and self._send(link, msg)

    def on_worker_message(self, msg_type: type, handler: Callable[[WorkerLink, Any], None]) -> None:
        """Route a worker message type (e.g. the serving path's TokensGenerated) to ``handler``,
        called on the loop thread. Register before ``start``."""
        self._handlers[msg_type] = handler

    def _recv_worker(self) -> bool:
        self._recv_ns = time.time_ns()
        try:
            identity, msg = self._router.recv()
        except zmq.Again:
            return False
        except TransportError as e:
            self.metrics[f"bad_message_{e.name}"] += 1
            log.warning("bad_worker_message", error=e.name, detail=e.detail, identity=repr(e.identity[:32]))
            self._reply_error(e.identity, e.reply())
            return True
        link = self._links.get(identity)
        if link is None:
            if type(msg) is Hello:
                self._on_hello_new(identity, msg)
            elif type(msg) is not ErrorReply:      # never answer an error with an error
                self.metrics["unknown_worker_messages"] += 1
                log.warning("unknown_worker_message", identity=repr(identity[:32]), type=type(msg).__name__)
                self._reply_error(identity, ErrorReply(error=UNKNOWN_WORKER,
                                                       detail=f"{identity[:32]!r} has not said Hello"))
            return True
        link.last_heard_ns = time.monotonic_ns()
        if link.missed:
            link.missed = False
        claimed = getattr(msg, "worker", link.worker)
        if claimed != link.worker:
            log.warning("worker_mismatch", worker=link.worker, claimed=claimed, type=type(msg).__name__)
            self._reply_error(identity, ErrorReply(error=WORKER_MISMATCH,
                                                   detail=f"message names worker {claimed}, sender is {link.worker}"))
            return True
        handler = self._handlers.get(type(msg))
        if handler is None:
            if type(msg) not in self._unhandled_logged:
                self._unhandled_logged.add(type(msg))
                log.warning("unhandled_worker_message", type=type(msg).__name__, worker=link.worker)
            return True
        try:
            handler(link, msg)
        except (ControlError, LedgerDiverged):
            raise
        except Exception:  # noqa: BLE001 - one message's bug must not stop the control process
            self.metrics["handler_failed"] += 1
            log.exception("worker_message_handler_failed", type=type(msg).__name__, worker=link.worker)
        return True

    def _reply_error(self, identity: bytes, err: ErrorReply) -> None:
        try:
            self._router.send(identity, err)
        except WorkerUnreachable:
            pass

    def _on_hello(self, link: WorkerLink, msg: Hello) -> None:
        if msg.epoch == link.epoch:      # the worker thought we restarted; ask again what it knows
            self._query(link, recovery.asked_of(self.state, link.worker, self.book))
            return
        self._on_hello_new(link.identity, msg)

    def _on_hello_new(self, identity: bytes, msg: Hello) -> None:
        w, now = msg.worker, time.monotonic_ns()
        if parse_worker_identity(identity) != w:
            self._reply_error(identity, ErrorReply(error=WORKER_MISMATCH,
                                                   detail=f"Hello from {identity[:32]!r} names worker {w}"))
            return
        if self.cfg.expected_workers is not None and w not in self.cfg.expected_workers:
            log.warning("unexpected_worker", worker=w, expected=self.cfg.expected_workers)
            self._reply_error(identity, ErrorReply(error=UNKNOWN_WORKER, detail=f"worker {w} is not expected here"))
            return
        ws = self.state.workers.get(w)
        old = self._by_worker.get(w)
        if old is not None and old.epoch != msg.epoch:
            self._lose(w, f"replaced by a new incarnation (epoch {msg.epoch})")
        elif ws is not None and ws.alive and self.roster.get(w) != msg.epoch and self._has_history(w):
            self._lose(w, f"not back after the control restart; epoch {msg.epoch} replaces {self.roster.get(w)}")
        ws = self.state.workers.get(w)
        if ws is not None and not ws.alive and self.roster.get(w) == msg.epoch:
            # NOTE: the ledger already wrote this incarnation off (its blocks are counted lost);
            # adopting it would bring back memory the ledger no longer accounts for.
            log.warning("lost_worker_returned", worker=w, epoch=msg.epoch)
            self._reply_error(identity, ErrorReply(error=WORKER_LOST, detail=f"worker {w} epoch {msg.epoch} was recorded lost"))
            try:
                self._router.send(identity, Shutdown(reason="recorded lost; a new incarnation replaces it"))
            except WorkerUnreachable:
                pass
            return
        link = WorkerLink(w, identity, msg.epoch, msg.device, now)
        self._links[identity] = self._by_worker[w] = link
        adopted = ws is not None and ws.alive and self.roster.get(w) == msg.epoch
        self._adopting.pop(w, None)
        if adopted:
            log.info("worker_adopted", worker=w, epoch=msg.epoch)
        else:
            self._record(ev.WorkerJoined(worker=w, device=msg.device, tiers=dict(msg.tiers), block_bytes=msg.block_bytes),
                         causation=recovery.join_causation(w, msg.epoch))
            self.roster[w] = msg.epoch
            log.info("worker_joined", worker=w, epoch=msg.epoch, device=msg.device, tiers=msg.tiers,
                     block_bytes=msg.block_bytes)
        self._query(link, recovery.asked_of(self.state, w, self.book))
        for req in self._unsent.pop(w, []):
            self._dispatch(req)

    def _has_history(self, w: int) -> bool:
        return bool(self.state.blocks.get(w)) or any(
            m.worker == w for m in (*self.state.inflight.values(), *self.state.stranded.values()))

    def _query(self, link: WorkerLink, move_ids: list[str]) -> None:
        if move_ids:
            link.asked.update(move_ids)
            link.last_query_ns = time.monotonic_ns()
            self._send(link, QueryMoves(move_ids=move_ids))

    def _on_pong(self, link: WorkerLink, msg: Pong) -> None:
        self.metrics["pongs"] += 1

    def _on_worker_error(self, link: WorkerLink, msg: ErrorReply) -> None:
        self.metrics[f"worker_error_{msg.error}"] += 1
        log.warning("worker_error", worker=link.worker, error=msg.error, detail=msg.detail)

    def _heartbeats(self, now: int) -> None:
        ping = Ping(nonce=now & 0x7FFFFFFF, ts_ns=time.time_ns())
        for link in list(self._links.values()):
            self._send(link, ping)
        for w, until in list(self._adopting.items()):
            if now > until:
                del self._adopting[w]
                self._lose(w, f"did not come back within {self.cfg.adopt_grace_s} s of the control restart")
            else:   # a surviving worker answers a ping; we answer unknown_worker; it says Hello again
                try:
                    self._router.send(worker_identity(w), ping)
                except WorkerUnreachable:
                    pass
        heard = {link.worker: link.last_heard_ns for link in self._links.values()}
        missed, lost = watchdog.silence(heard, now, int(self.cfg.heartbeat_missed_s * S), int(self.cfg.worker_lost_s * S),
                                        {lk.worker for lk in self._links.values() if lk.missed})
        for e in missed:
            self._by_worker[e.worker].missed = True
            log.warning("worker_heartbeat_missed", worker=e.worker, silent_ms=e.silent_ms)
            self._record(e)
        for w, silent_ms in lost:
            self._lose(w, f"heartbeat silent {silent_ms} ms")

    def _lose(self, worker: int, reason: str) -> None:
        link = self._by_worker.pop(worker, None)
        if link is not None:
            self._links.pop(link.identity, None)
        self._adopting.pop(worker, None)
        for e in watchdog.loss(self.state, worker, reason, self.book.undispatched):
            if type(e) is ev.WorkerLost:
                self.busy.drop_worker(worker)
                log.warning("worker_lost", worker=worker, reason=reason, blocks_lost=len(e.blocks_lost),
                            bytes_lost=e.bytes_lost)
                self._record(e)
            else:
                self._settle(e.move_id, e)

    def missing_workers(self) -> list[int]:
        """Expected workers with no live link and no grace pending: the supervisor starts these."""
        expected = self.cfg.expected_workers or []
        return [w for w in expected if w not in self._by_worker and w not in self._adopting]

    # ================================================================== moves
    def _request(self, ask, waiter: moves.AskWaiter | None) -> str:
        self._num_moves += 1
        mid = moves.move_id(self.epoch, self._num_moves)
        req = moves.requested(self.state, ask, mid, time.time_ns(), self.cfg.moves)
        seq = self._record(req, correlation=ask.session, causation=ask.asker)
        self.book.requested(seq, req, waiter)
        self.busy.add(ask.worker, ask.blocks)
        if self.traces.keep:
            self.traces.mark(mid, "asked", self._ask_ns)
            self.traces.mark(mid, "requested")
        return mid

    def _dispatch(self, req: ev.MoveRequested) -> None:
        """The MoveRequested is committed: now (and only now) the command may leave."""
        if req.move_id not in self.state.inflight:
            self.book.undispatched.discard(req.move_id)
            return   # settled meanwhile (worker lost, deadline)
        link = self._by_worker.get(req.worker)
        if link is None:   # not back yet: sent when it is, or settled by the watchdog / its loss
            self._unsent.setdefault(req.worker, []).append(req)
            return
        self.faults.hit("crash_after_requested")
        self.traces.mark(req.move_id, "committed")
        if self._send(link, moves.command_for(req)):
            self.traces.mark(req.move_id, "sent")
            self.book.sent(req.move_id, time.monotonic_ns())
            self.faults.hit("crash_after_dispatch", delay_s=0.05)

    def _on_outcome(self, link: WorkerLink, msg) -> None:
        self.faults.hit("crash_before_ack_append")
        if self.traces.keep:
            self.traces.mark(msg.move_id, "received", self._recv_ns)
            self.traces.mark(msg.move_id, "decoded")
        verdict, event = moves.classify(self.state, link.worker, msg)
        self.metrics[f"outcome_{verdict}"] += 1
        if verdict == moves.LATE_FAILURE:
            self._stranded_answered(msg.move_id)
        if event is None:
            log.info("outcome_not_recorded", verdict=verdict, move_id=msg.move_id, worker=link.worker,
                     type=type(msg).__name__, why=getattr(msg, "reason", None) or getattr(msg, "error", None))
            return
        self._settle(msg.move_id, event)
        self.traces.mark(msg.move_id, "recorded")

    def _on_timed(self, link: WorkerLink, msg: MoveTimed) -> None:
        if self.traces.keep and msg.move_id in self.traces.by_move:
            for phase in ("received_ns", "queued_ns", "engine_start_ns", "engine_end_ns", "sent_ns"):
                self.traces.mark(msg.move_id, "w_" + phase.removesuffix("_ns"), getattr(msg, phase))

    def _on_released(self, link: WorkerLink, msg: BlocksReleased) -> None:
        self._on_outcome(link, moves.release_outcome(msg, time.time_ns()))

    def _on_report(self, link: WorkerLink, msg: MovesReport) -> None:
        settled = recovery.reconcile(self.state, link.worker, msg, sorted(link.asked))
        for verdict, event in settled:
            self.metrics[f"reconciled_{verdict}"] += 1
            self._settle(event.move_id, event)
        for mid in [*msg.unknown, *(o.move_id for o in msg.outcomes if type(o) is not ev.MoveAcked)]:
            mv = self.state.stranded.get(mid)
            if mv is not None and mv.worker == link.worker:   # answered for: it will never run now
                self._stranded_answered(mid)
        link.asked.difference_update(msg.unknown)
        link.asked.difference_update(o.move_id for o in msg.outcomes)
        if settled:
            log.info("moves_reconciled", worker=link.worker, settled=len(settled), unknown=len(msg.unknown))

    def _stranded_answered(self, mid: str) -> None:
        mv = self.state.stranded.get(mid)
        if mv is not None and mid not in self.answered_stranded:
            self.answered_stranded.add(mid)
            self.busy.remove(mv.worker, mv.blocks)
            log.warning("stranded_move_never_landed", move_id=mid, worker=mv.worker, bytes_at_risk=mv.bytes_planned)

    def reserved_bytes(self) -> dict[tuple[int, str], int]:
        return budget.stranded_toward(self.state, self.answered_stranded)

    def _settle(self, mid: str, event: ev.Event) -> None:
        """Record a move's terminal (or late) event, its session follow-ups, and tell its asker."""
        mv = self.state.inflight.get(mid) or self.state.stranded.get(mid)
        if mv is None:
            return
        recorded = [(self._record(e, correlation=mv.session, causation=mid), e)
                    for e in moves.settle_events(mv, event, self.cfg.moves)]
        if type(event) is not ev.MoveStranded:
            self.busy.remove(mv.worker, mv.blocks)
        if type(event) is ev.MoveLateAcked:
            return
        waiter = self.book.settled(mid)
        if waiter is not None:
            waiter.events.extend(recorded)
            waiter.open.discard(mid)
            if waiter.done:
                self._answer_after(waiter)

    def _watch_deadlines(self) -> None:
        if self._commits_pending:
            now = time.monotonic_ns()
            for ref in [r for r, c in self._commits_pending.items() if c[5] < now]:
                waiter = self._commits_pending.pop(ref)[0]
                log.warning("commit_timeout", ref=ref)
                waiter.answer([], [], "commit_timeout", f"the worker did not answer commit {ref}")
        if not self.state.inflight:
            return
        now = time.time_ns() - int(self.cfg.deadline_grace_s * S)
        for e in watchdog.overdue(self.state, now, self.book.undispatched, self._adopting):
            log.warning("move_overdue", move_id=e.move_id, worker=e.worker, outcome=type(e).__name__)
            self._settle(e.move_id, e)

    def _requery(self, now: int) -> None:
        """Ask workers about their stranded moves: a dropped ack comes back as MoveLateAcked."""
        stranded: dict[int, list[str]] = {}
        for mid, mv in self.state.stranded.items():
            if mid not in self.answered_stranded:
                stranded.setdefault(mv.worker, []).append(mid)
        for w, mids in stranded.items():
            link = self._by_worker.get(w)
            if link is not None:
                self._query(link, mids[:4096])

    def _run_policies(self) -> None:
        now = time.time_ns()
        busy = self.busy.by_worker
        in_use = self.blocks_in_use()
        if in_use:
            busy = {w: busy.get(w, set()) | in_use.get(w, set()) for w in set(busy) | set(in_use)}
        cfg = self.cfg.policy
        mono = time.monotonic_ns()
        if cfg.park and mono < self._next_park:     # parking looks at every block: once a second is plenty
            cfg = msgspec.structs.replace(cfg, park=False)
        elif cfg.park:
            self._next_park = mono + S
        for ask in plan(self.state, self.recency, now, cfg, self.memo, busy):
            try:
                moves.validate(self.state, ask, busy)
            except moves.InvalidAsk:
                continue
            refusal = moves.fund(self.state, [ask], self.reserved_bytes())
            if refusal is not None:
                self.memo.note(ask, refusal.available_bytes, now)
                log.info("move_refused", asker=ask.asker, worker=ask.worker, tier=refusal.tier,
                         asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
                self._record(refusal.event(ask.asker, ask.session), correlation=ask.session)
                continue
            self._request(ask, None)

    # ================================================================== asks
    def _recv_ask(self) -> bool:
        try:
            identity, msg = self._asks.recv()
        except zmq.Again:
            return False
        except TransportError as e:
            log.warning("bad_ask", error=e.name, detail=e.detail)
            self._asks.send(e.identity, e.reply())
            return True
        self._on_ask_guarded(msg, "operator", lambda reply, _id=identity: self._asks.send(_id, reply))
        return True

    def _on_ask_guarded(self, msg, asker: str, reply: Callable) -> None:
        try:
            self._on_ask(msg, asker, reply)
        except (ControlError, LedgerDiverged):
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged once; the loop goes on
            self.metrics["ask_failed"] += 1
            log.exception("ask_failed", ask=type(msg).__name__, asker=asker)
            reply(AskAnswered(ask_id=getattr(msg, "ask_id", ""), error="internal_error", detail=repr(e)))

    def _on_ask(self, msg, asker: str, reply: Callable) -> None:
        ask_id = getattr(msg, "ask_id", "")
        self._ask_ns = time.time_ns()
        if type(msg) is AskStatus:
            reply(self.status_report(ask_id, msg.include_state))
            return
        waiter = moves.AskWaiter(ask_id, lambda events, mids, error, detail: reply(AskAnswered(
            ask_id=ask_id, events=[e for _, e in events], seqs=[s for s, _ in events], move_ids=mids,
            error=error, detail=detail)), wait=getattr(msg, "wait", True))
        if self._stop_reason is not None:
            waiter.answer([], [], "shutting_down", "the control process is stopping")
            return
        try:
            if type(msg) is AskMove:
                self._ask_move(msg, f"{asker}:{msg.kind}", waiter)
            elif type(msg) is AskReleaseBlocks:
                ask = release(f"{asker}:release", msg.worker, msg.tier, msg.blocks, msg.reason)
                moves.validate(self.state, ask, self.busy.by_worker)
                self._request(ask, waiter)
            elif type(msg) is AskSetBudget:
                problem = budget.check_budget(self.state, msg.worker, msg.tier, msg.floor_bytes, msg.ceiling_bytes)
                if problem:
                    raise moves.InvalidAsk(problem)
                e = ev.BudgetSet(worker=msg.worker, tier=msg.tier, floor_bytes=msg.floor_bytes,
                                 ceiling_bytes=msg.ceiling_bytes)
                waiter.events.append((self._record(e, causation=f"{asker}:budget"), e))
            elif type(msg) is AskCommitBlocks:
                self._ask_commit(msg, waiter)
            else:
                raise moves.InvalidAsk(f"{type(msg).__name__} is not an ask")
        except moves.InvalidAsk as e:
            log.info("invalid_ask", ask_id=ask_id, asker=asker, detail=str(e))
            waiter.answer([], [], INVALID_ASK, str(e))
            return
        if not waiter.wait and waiter.move_ids:
            waiter.open.clear()
            for mid in waiter.move_ids:
                self.book.waiters.pop(mid, None)
        if waiter.done:
            self._answer_after(waiter)

    def _ask_move(self, msg: AskMove, asker: str, waiter: moves.AskWaiter) -> None:
        asks = moves.resolve(self.state, msg, asker, self.busy.by_worker)
        refusal = moves.fund(self.state, asks, self.reserved_bytes())
        if refusal is not None:
            e = refusal.event(asker, msg.session)
            log.info("move_refused", asker=asker, worker=refusal.worker, tier=refusal.tier,
                     asked_bytes=refusal.asked_bytes, available_bytes=refusal.available_bytes)
            waiter.events.append((self._record(e, correlation=msg.session, causation=msg.ask_id or None), e))
            return
        for a in asks:
            self._request(a, waiter)

    def _ask_commit(self, msg: AskCommitBlocks, waiter: moves.AskWaiter) -> None:
        ws = self.state.workers.get(msg.worker)
        link = self._by_worker.get(msg.worker)
        if ws is None or not ws.alive or link is None:
            raise moves.InvalidAsk(f"worker {msg.worker} is not serving")
        if msg.num_blocks <= 0:
            raise moves.InvalidAsk("num_blocks must be > 0")
        acc = ws.tiers[msg.tier]
        nbytes = msg.num_blocks * ws.block_bytes
        pending = sum(c[4] for c in self._commits_pending.values() if c[1] == msg.worker and c[2] == msg.tier)
        room = budget.limit_bytes(acc) - acc.used_bytes - acc.inflight_in_bytes - pending
        if nbytes > room:
            raise moves.InvalidAsk(f"no room for {nbytes} bytes on {msg.tier} of worker {msg.worker}: "
                                   f"limit {budget.limit_bytes(acc)} - used {acc.used_bytes} - in flight "
                                   f"{acc.inflight_in_bytes} - committing {pending} = {room}")
        blocks = self.allocate_block_ids(msg.worker, msg.num_blocks)
        self._num_refs += 1
        ref = f"c-{self.epoch:x}-{self._num_refs}"
        self._commits_pending[ref] = (waiter, msg.worker, msg.tier, msg.session, nbytes,
                                      time.monotonic_ns() + int(self.cfg.moves.deadline_base_s * S))
        waiter.open.add(ref)
        self._send(link, CommitBlocks(request_id=ref, session=msg.session, tier=msg.tier, blocks=blocks, seed=msg.seed))

    def allocate_block_ids(self, worker: int, n: int) -> list[int]:
        """``n`` block ids never used on ``worker`` (the one allocator: commits and the serving
        path's pages). Loop thread only."""
        first = self._next_block.get(worker)
        if first is None:
            # NOTE: a gap after a restart: a commit the last incarnation sent but never recorded may
            # have used ids above the ledger's highest; never hand those out again.
            top = max(self.state.blocks.get(worker, {}) or [-1])
            first = ((top + 1) // (1 << 20) + 1) * (1 << 20) if self.recovered and self.recovered.crashed else top + 1
        self._next_block[worker] = first + n
        return list(range(first, first + n))

    def _on_written(self, link: WorkerLink, msg: BlocksWritten) -> None:
        entry = self._commits_pending.pop(msg.request_id, None)
        session = entry[3] if entry else None
        e = ev.BlocksCommitted(worker=link.worker, session=session, tier=msg.tier, blocks=list(msg.blocks),
                               keys=list(msg.keys), bytes=msg.bytes)
        seq = self._record(e, correlation=session, causation=msg.request_id)
        if entry is not None:
            waiter = entry[0]
            waiter.events.append((seq, e))
            waiter.open.discard(msg.request_id)
            if waiter.done:
                self._answer_after(waiter)

    def _on_command_failed(self, link: WorkerLink, msg: CommandFailed) -> None:
        log.warning("command_failed", worker=link.worker, ref=msg.ref, error=msg.error, detail=msg.detail)
        entry = self._commits_pending.pop(msg.ref, None)
        if entry is not None:
            entry[0].answer([], [], msg.error, msg.detail)
            return
        mv = self.state.inflight.get(msg.ref)
        if mv is not None and mv.worker == link.worker:
            self._settle(msg.ref, ev.MoveFailed(move_id=msg.ref, worker=link.worker,
                                                error=f"{msg.error}: {msg.detail}", bytes_moved=None))

    def _answer_after(self, waiter: moves.AskWaiter) -> None:
        """Answer once everything recorded for the ask is committed."""
        need = max((s for s, _ in waiter.events), default=0)
        if not waiter.wait and waiter.move_ids:      # answered once its MoveRequesteds are committed
            mine = set(waiter.move_ids)
            need = max([need] + [s for s, req in self.book.awaiting_commit if req.move_id in mine])
        self._answers.append((need, waiter))

    def _answer(self, waiter: moves.AskWaiter) -> None:
        if self.traces.keep:
            for mid in waiter.move_ids:
                self.traces.mark(mid, "answered")
        waiter.events.sort(key=lambda p: p[0])
        waiter.answer(waiter.events, waiter.move_ids, None, "")

    def status_report(self, ask_id: str = "", include_state: bool = True) -> StatusReport:
        h = self.health()
        metrics = dict(h.metrics)
        metrics.update(committed_seq=float(self._recorder.committed), workers_linked=float(len(self._links)),
                       epoch=float(self.epoch))
        return StatusReport(ask_id=ask_id, last_seq=self.state.last_seq, state_hash=state_hash(self.state),
                            healthy=h.healthy, problems=h.problems, metrics=metrics,
                            state=encode_state(self.state) if include_state else b"")

    # ================================================================== stopping
    def _shutdown(self, reason: str) -> None:
        """Settle what is in flight, free every copy by the book, record ServerStopped, stop workers."""
        log.info("control_stopping", reason=reason, in_flight=len(self.state.inflight))
        self._serve_until(lambda: not self.state.inflight, self.cfg.shutdown_grace_s)
        for mid, mv in list(self.state.inflight.items()):
            self._settle(mid, ev.MoveAbandoned(move_id=mid, worker=mv.worker, why=f"server stopping: {reason}"))
        if self.cfg.release_on_stop:
            for w, link in list(self._by_worker.items()):
                by_tier: dict[str, list[int]] = {}
                for b, st in self.state.blocks.get(w, {}).items():
                    for t in st.tiers:
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
