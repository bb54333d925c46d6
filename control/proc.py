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

The parts of the class, one role per module (each runs on the loop thread):

    control/startstop.py   StartStop       recover at start (the loop's fields), settle at stop
    control/links.py       WorkerLinks     workers: Hello and adoption, heartbeats, loss, messages
    control/lifecycle.py   MoveLifecycle   moves: request, dispatch after commit, outcome, deadlines
    control/asking.py      Asks            asks from the API and operators, and their answers
    control/recorder.py    Recorder        the ledger's producer side: fold now, commit after
    control/probes.py      ControlFaults, MoveTraces   test and bench hooks, off unless named
"""
from __future__ import annotations

import collections
import gc
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import structlog
import zmq

from residency.events import affinity
from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, BlocksWritten, CommandFailed, DiskClaimed, ErrorReply, Hello, MoveNearlyDone, MovesReport,
    MoveTimed, Pong,
)
from residency.control.asking import Asks
from residency.control.config import ControlConfig, Health
from residency.control.errors import ControlError, LedgerDiverged
from residency.control.keep_awake import KeepAwake
from residency.control.lifecycle import MoveLifecycle
from residency.control.links import WorkerLink, WorkerLinks
from residency.control.policy.recency import Recency
from residency.control.probes import ControlFaults, MoveTraces
from residency.control.recorder import Recorder
from residency.control.startstop import SERVER_VERSION, StartStop
from residency.control.state import State, encode_state, state_hash
from residency.control.transport import AskServer, WorkerRouter

log = structlog.get_logger("control.proc")
MS, S = 1_000_000, 1_000_000_000
QUIET_NEVER_NS = 3600 * S       # the "quiet" timer when no heavy work waits for a quiet iteration

__all__ = ["ControlConfig", "ControlProc", "Health", "ControlError", "LedgerDiverged", "ControlFaults", "MoveTraces",
           "Recorder", "WorkerLink", "SERVER_VERSION"]


class ControlProc(StartStop, WorkerLinks, MoveLifecycle, Asks):
    def __init__(self, store, config: ControlConfig, writer_factory: Callable | None = None,
                 ctx: zmq.Context | None = None):
        self.store = store
        self.cfg = config
        self.faults = ControlFaults(config.faults or os.environ.get("RESIDENCY_CONTROL_FAULTS", ""))
        self._own_ctx = ctx is None and config.cpu is not None
        self._ctx = ctx or affinity.context_on(config.cpu)
        self._awake: dict[str, int] = {}      # move_id -> poll awake until (monotonic ns): MoveNearlyDone
        self._warm_at = 0                       # monotonic ns: warm the ledger writer then (0: no)
        self._warm_bytes = 0                    # ... for an ack of about this many payload bytes
        self._warm_move = ""                    # ... of this move
        self._keep_awake = None                 # control.keep_awake.KeepAwake (cfg.keep_awake), from _run
        self._awake_moves: set[str] = set()     # big moves in flight that keep the host awake
        self._writer_factory = writer_factory or self._default_writer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop_reason: str | None = None
        self._fatal: BaseException | None = None
        self._stopped = threading.Event()
        self._frozen = False
        self._acted = False           # this loop iteration sent a command or answered an asker
        self._policy_due = 0          # when the policies held for a quiet iteration were due
        self._beat_ns = time.monotonic_ns()
        self._handlers: dict[type, Callable] = {
            Hello: self._on_hello, Pong: self._on_pong, ev.MoveAcked: self._on_outcome,
            ev.MoveFailed: self._on_outcome, ev.MoveRejected: self._on_outcome, BlocksReleased: self._on_released,
            BlocksWritten: self._on_written, MovesReport: self._on_report, CommandFailed: self._on_command_failed,
            ErrorReply: self._on_worker_error, MoveTimed: self._on_timed, MoveNearlyDone: self._on_nearly_done,
            DiskClaimed: self._on_disk_claimed,
        }
        self._unhandled_logged: set[type] = set()
        self._listeners: list[Callable[[int, ev.Event], None]] = []
        # Blocks the serving path is using right now (worker -> ids): policies never move them.
        self.blocks_in_use: Callable[[], dict[int, set[int]]] = lambda: {}
        self.metrics: collections.Counter = collections.Counter()
        self.traces = MoveTraces(config.trace_moves)
        # set by _recover()
        self._stopped_cleanly = False
        self._replacing: dict[int, int] = {}
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
        self._post(("ask", ask, asker, fut.set_result, self._off_loop()))
        return fut

    def submit_many(self, asks, asker: str = "api") -> list["Future"]:
        """``submit`` for many asks at once: one wake of the loop, and their events share commits."""
        futs = [Future() for _ in asks]
        for ask, fut in zip(asks, futs):
            self._inbox.put(("ask", ask, asker, fut.set_result, self._off_loop()))
        self._wake()
        return futs

    def _off_loop(self) -> str:
        """"thread" when the caller is another thread of this process: its answer may come
        before the ack's fold (MoveLifecycle._settle). "" on the loop's thread: loop-thread
        askers (the serving path) react to an answer in a future's callback, on the loop thread,
        reading the state, so they hear after the fold."""
        return "thread" if threading.current_thread() is not self._thread else ""

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
            if self.cfg.keep_awake:
                self._keep_awake = KeepAwake()
            self._recover()
            affinity.pin_this_thread(self.cfg.cpu)   # after the ledger writer's thread started: it stays unplaced
            if self.cfg.gc_freeze:
                # NOTE: the process's modules and the recovered state live as long as the loop: out of
                # the collector's sight, a full collection (~90 ms with torch in the process) scans
                # only what came after. Unfrozen at stop, so what dies with the loop is collected.
                gc.freeze()
                self._frozen = True
            self._ready.set()
            while self._stop_reason is None:
                self._poll()
                self._recorder.flush()
                self._acted = self._commits()
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
        from residency.ledger.writer import GroupCommitWriter
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
        if self._keep_awake is not None:
            self._keep_awake.stop()
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
        for name in ("_router", "_asks"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        if self._own_ctx:
            self._ctx.destroy(linger=0)
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

    def _poll(self) -> None:
        self._beat_ns = now = time.monotonic_ns()
        # rounded up: a timer due in under a ms is waited for, not polled for in a busy loop
        timeout_ms = -(-max(0, min(self._next.values()) - now) // MS)
        self._recorder.arm(self._wake)
        events = self._poll_awake(now, timeout_ms) if self._awake else None
        if events is None:
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

    def _poll_awake(self, now: int, timeout_ms: int) -> dict | None:
        """Poll awake (``affinity.poll_until``) while a worker said a move's outcome is about to
        come (MoveNearlyDone), at most until the next timer; None when no such wait is on (then
        the caller sleeps in the poll as usual)."""
        self._awake = {m: t for m, t in self._awake.items() if t > now}
        if not self._awake:
            self._warm_at = 0
            return None
        self.metrics["awake_polls"] += 1
        until = min(max(self._awake.values()), now + timeout_ms * MS)
        if self._warm_at:               # the ledger writer is to be warmed before the ack comes
            ready = affinity.poll_until(self._poller, min(until, self._warm_at), self.cfg.cpu is not None)
            if ready:
                return dict(ready)
            if time.monotonic_ns() >= self._warm_at:
                self._warm_at = 0
                if self._recorder.warm(self._warm_bytes):
                    self.metrics["writer_warm_ups"] += 1
                    self.traces.mark(self._warm_move, "warmed")
        return dict(affinity.poll_until(self._poller, until, self.cfg.cpu is not None))

    def _on_nearly_done(self, link: WorkerLink, msg: MoveNearlyDone) -> None:
        self.traces.mark(msg.move_id, "nearly_done")
        self.metrics["nearly_done_hints"] += 1
        cap = self.cfg.ack_spin_max_us * 1000
        if cap and msg.move_id in self.state.inflight:
            now = time.monotonic_ns()
            until = now + min(cap, msg.bytes_left // 10)    # 10 GB/s = 10 B/ns
            self._awake[msg.move_id] = max(until, self._awake.get(msg.move_id, 0))
            if self.cfg.warm_writer:    # its ack's commit comes next: warm the writer just before
                self._warm_at = now + max(1, (msg.eta_us - self.cfg.warm_lead_us) * 1000)
                self._warm_bytes = 8 * len(self.state.inflight[msg.move_id].blocks)   # its checksums
                self._warm_move = msg.move_id

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "ask":
                _, ask, asker, reply, off_loop = item
                self._on_ask_guarded(ask, asker, reply, off_loop)
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

    def _commits(self) -> bool:
        """Send the commands and answers whose events are committed; True when any went."""
        committed = self._recorder.advance()
        acted = False
        for req in self.book.committed(committed):
            self._dispatch(req)
            acted = True
        answers = self._answers
        while answers and answers[0][0] <= committed:
            _, waiter = answers.popleft()
            self._answer(waiter)
            acted = True
        if self._snapshot_pending and self._snapshot_pending[0] <= committed:
            through, data, digest = self._snapshot_pending
            self._snapshot_pending = None
            self.store.save_snapshot(through, data, digest)
            self._last_snapshot_seq = through
            log.info("snapshot_saved", through_seq=through, bytes=len(data))
        return acted

    def _tick(self) -> None:
        now = time.monotonic_ns()
        nxt = self._next
        # NOTE: a policy's scan and a checkpoint's hash hold the loop (and the GIL, and on a small
        # host a core) for O(blocks). In the iteration that just sent a command or answered an
        # asker they would stand in the way of the worker starting that move and of an in-process
        # asker taking its answer: they wait for a quiet iteration (the poll wakes 1 ms later for
        # one), one period at most. A checkpoint due by its event count never waits.
        wait = self._acted
        nxt["quiet"] = now + QUIET_NEVER_NS
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
            period = int(self.cfg.policy_interval_s * S)
            due = self._policy_due = self._policy_due or nxt["policy"]
            if wait and now - due < period:
                nxt["policy"] = now + MS
            else:
                self._policy_due = 0
                nxt["policy"] = now + period
                if not self._adopting:
                    self._run_policies()
        pseq, at = self._last_ckpt
        if self._recorder.producer_seq > pseq:
            every = int(self.cfg.checkpoint_every_s * S)
            if self._recorder.producer_seq - pseq >= self.cfg.checkpoint_every_events:
                self._checkpoint(now)
            elif now - at >= every:
                if wait and now - at < 2 * every:
                    nxt["quiet"] = now + MS
                else:
                    self._checkpoint(now)

    # ================================================================== recording
    def record(self, event: ev.Event, correlation: str | None = None, causation: str | None = None,
               fold_later: bool = False) -> int:
        """Fold ``event`` into the live state and queue it for the ledger; returns its seq.
        Loop thread only (handlers, ``call``). It is committed by the end of this loop iteration
        (or handed to the group-commit writer, when commits are already in flight).
        ``fold_later``: folded (and the listeners told) at ``_fold_deferred``, which the caller
        runs before its handler returns (MoveLifecycle._settle: commit and answer first)."""
        self.metrics[f"recorded_{type(event).__name__}"] += 1
        if self._recorder.unfolded and not fold_later:
            self._fold_deferred()
        seq = self._recorder.record(event, correlation, causation, fold_later)
        if not fold_later:
            self._tell_listeners(seq, event)
        return seq

    def _fold_deferred(self) -> None:
        for rec in self._recorder.fold_deferred():
            self._tell_listeners(rec.envelope.seq, rec.event)

    def _tell_listeners(self, seq: int, event: ev.Event) -> None:
        for listener in self._listeners:
            try:
                listener(seq, event)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the ledger's writer
                log.exception("listener_failed", listener=getattr(listener, "__qualname__", repr(listener)))

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
