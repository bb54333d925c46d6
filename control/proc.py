"""ControlProc: the control process's shell around the pure core (fold, policies, moves, watchdog).

One thread owns the sockets, the live state and the ledger writer's producer side:

    recover()                          replay the ledger; compose the parts around its state
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

The parts, each owning its state (made on the loop thread once the ledger is replayed):

    recorder     control/recorder.py   Recorder: the ledger's producer side, fold now, commit after;
                                       Checkpoints: StateCheckpoint and snapshots
    workers      control/links.py      WorkerRegistry: Hello and adoption, heartbeats, loss, messages
    moves        control/lifecycle.py  MoveDispatcher: request, dispatch after commit, outcome, deadlines
    asks         control/asking.py     AskHandler: asks from the API and operators
    answers      control/answers.py    Answers: who waits for an answer, sent after its commit
    awake        control/awake_poll.py AwakePoll: poll awake for an outcome about to come
    keep_awake   control/keep_awake.py AwakeWhileMoving: the host kept awake while big moves run
    start, stop  control/startstop.py  recover, Parts (composes the above), shut_down
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

from residency.events import catalog as ev
from residency.control import dial, flip, recovery
from residency.control.anchoring import Anchoring
from residency.control.config import ControlConfig, Health
from residency.control.errors import ControlError, LedgerDiverged
from residency.control.keep_awake import AwakeWhileMoving
from residency.control.links import WorkerLink
from residency.control.peer_gate import PeerGate
from residency.control.policy.recency import Recency
from residency.control.probes import ControlFaults, MoveTraces
from residency.control.recorder import Recorder
from residency.control.startstop import SERVER_VERSION, Parts, recover, shut_down
from residency.control.state import State
from residency.control.groups import GroupBook
from residency.control.transport import AskServer, WorkerRouter

log = structlog.get_logger("control.proc")
MS, S = 1_000_000, 1_000_000_000
QUIET_NEVER_NS = 3600 * S       # the "quiet" timer when no heavy work waits for a quiet iteration

__all__ = ["ControlConfig", "ControlProc", "Health", "ControlError", "LedgerDiverged", "ControlFaults", "MoveTraces",
           "Recorder", "WorkerLink", "SERVER_VERSION"]


class ControlProc:
    def __init__(self, store, config: ControlConfig, ctx: zmq.Context | None = None):
        """``ctx``: the ZMQ context for the control's sockets (the process's shared one if None;
        bench/placement.py hands it one whose I/O thread is placed on a CPU)."""
        self.store = store
        self.cfg = config
        self.faults = ControlFaults(config.faults or os.environ.get("RESIDENCY_CONTROL_FAULTS", ""))
        self.traces = MoveTraces(config.trace_moves)
        self.metrics: collections.Counter = collections.Counter()
        # Blocks the serving path is using right now (worker -> ids): policies never move them.
        self.blocks_in_use: Callable[[], dict[int, set[int]]] = lambda: {}
        # A worker's process is gone but its loss waits for the next incarnation (its disk copies,
        # WorkerRegistry): the serving path answers what ran there now (loop thread).
        self.worker_gone: Callable[[int], None] = lambda worker: None
        # The context floor of a serving worker's device pool (control/dial.py ContextFloor; None:
        # it serves no model): the dial refuses a shrink below it. Set by the serving path.
        self.context_of: Callable[[int], object] = lambda worker: None
        # NOTE: a ZAP handler serves a whole context: a keyed control owns one, so two of them
        # in one process (tests) never meet on the same handler
        self._own_ctx = ctx is None and config.peer_key is not None
        self._ctx = zmq.Context() if self._own_ctx else (ctx or zmq.Context.instance())
        self._gate: PeerGate | None = None
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
        self._handlers: dict[type, Callable] = {}           # worker message type -> handler (the parts')
        self._ask_handlers: dict[type, Callable] = {}       # ask type -> handler (the parts')
        self._pool_readers: dict[str, Callable] = {}        # the control's readers of device pools (the dial)
        self.dial = None                                    # control/dialing.py Dial, made by _recover()
        self.groups = GroupBook(config.groups) if config.groups else None    # serve --tp N
        self._listeners: list[Callable[[int, ev.Event], None]] = []
        self._stop_hooks: list[Callable[[str], None]] = []
        self._router: WorkerRouter | None = None
        self._ask_server: AskServer | None = None
        self._writer = None
        self.recorder: Recorder | None = None
        self.keep_awake: AwakeWhileMoving | None = None
        # made by _recover(), on the loop thread
        self.state = State()
        self.recency = Recency()
        self.epoch = 0

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
        before the ack's fold (MoveDispatcher.settle). "" on the loop's thread: loop-thread
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
        rec = self.recorder
        commit_lag = rec.lag_ns(now) if rec else 0
        stats = self._writer.stats() if self._writer is not None else {}
        stall = int(self.cfg.stall_after_s * S)
        if self._fatal is not None:
            problems.append(f"control loop failed: {self._fatal}")
        elif not self.running:
            problems.append("control loop not running")
        if loop_lag > stall:
            problems.append(f"control loop stalled for {loop_lag // MS} ms")
        if commit_lag > stall:
            problems.append(f"ledger commit lagging {commit_lag // MS} ms (queue {stats.get('queue_depth', 0)})")
        if self.dial is not None:
            problems.extend(self.dial.problems)     # a torn pool refuses requests until repaired
        if stats.get("queue_depth", 0) >= self.cfg.max_queue:
            problems.append(f"ledger back-pressure: queue full ({stats['queue_depth']})")
        metrics = {k: float(v) for k, v in dict(self.metrics).items()}
        if self._gate is not None:
            metrics.update(peers_refused=float(self._gate.num_refused))
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

    # ================================================================== before start, or on the loop thread
    def on_worker_message(self, msg_type: type, handler: Callable[[WorkerLink, Any], None]) -> None:
        """Route a worker message type (e.g. the serving path's TokensGenerated) to ``handler``,
        called on the loop thread. Register before ``start``."""
        self._handlers[msg_type] = handler

    def on_ask(self, ask_type: type, handler: Callable) -> None:
        """Route an ask type (an outside tenant's reclaim) to ``handler(msg, asker, waiter)`` on the
        loop thread; it answers through ``finish_ask``. Register before ``start``."""
        self._ask_handlers[ask_type] = handler

    def finish_ask(self, waiter, ref: str) -> None:
        """A part's ask handler is done with ``ref`` of ``waiter`` (loop thread only)."""
        self.asks.finish(waiter, ref)

    def add_listener(self, fn: Callable[[int, ev.Event], None]) -> None:
        """``fn(seq, event)`` on the loop thread after each event is folded (before its commit)."""
        self._listeners.append(fn)

    def add_pool_reader(self, name: str, fn: Callable[[State, int, int, int], int]) -> None:
        """A reader of every device pool in this process, stamped on each rebind (control/dialing.py):
        ``fn(state, worker, to_gen, to_bytes)`` returns the generation it carries now, called on the
        loop thread once the pool's PoolResized is folded. Register before ``start``."""
        self._pool_readers[name] = fn

    def add_stop_hook(self, fn: Callable[[str], None]) -> None:
        """``fn(reason)`` on the loop thread once the loop stops, before the shutdown settles the
        moves and records ``ServerStopped``: what a part still holds is closed by the book there."""
        self._stop_hooks.append(fn)

    def record(self, event: ev.Event, correlation: str | None = None, causation: str | None = None) -> int:
        """Fold ``event`` into the live state and queue it for the ledger; returns its seq (loop
        thread only: handlers, ``call``)."""
        return self.recorder.record(event, correlation, causation)

    def send_to_worker(self, worker: int, msg) -> bool:
        """Send any command to a joined worker (loop thread only; ``call`` from elsewhere); a
        serving command to a group's leader goes to every rank of the group (control/groups.py)."""
        sent = self.workers.send_to_worker(worker, msg)
        for w in self.groups.told_too(worker, msg) if self.groups is not None else ():
            sent = self.workers.send_to_worker(w, msg) and sent
        return sent

    def allocate_block_ids(self, worker: int, n: int) -> list[int]:
        return self.asks.allocate_block_ids(worker, n)

    def missing_workers(self) -> list[int]:
        """The workers the supervisor should start; not the ranks of a stopped group (a new rank
        cannot join the running ones: the group serves again once serve restarts)."""
        missing = self.workers.missing_workers()
        return missing if self.groups is None else [w for w in missing if not self.groups.is_stopped(w)]

    # ================================================================== the loop
    def _run(self) -> None:
        try:
            self._open()
            self._recover()
            # NOTE: the process's modules and the recovered state live as long as the loop: out of
            # the collector's sight, a full collection (tens of ms with torch in the process) scans
            # only what came after. Unfrozen at stop, so what dies with the loop is collected.
            gc.freeze()
            self._frozen = True
            self._ready.set()
            while self._stop_reason is None:
                self._poll()
                self.recorder.flush()
                self._acted = self._commits()
                # NOTE: after the commits, so a checkpoint's hash or a policy's scan never sits
                # between an outcome and its answer; what the tick records commits right here.
                self._tick()
                self.recorder.flush()
                self._commits()
            for hook in self._stop_hooks:
                hook(self._stop_reason)
            shut_down(self._stop_reason, self.cfg, self.state, self.recorder, self._writer, self.workers,
                      self.moves, self.answers, self._serve_until)
            if self.anchoring is not None:
                self.anchoring.write()          # the head at stop: ServerStopped and all before it
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
        key = self.cfg.peer_key
        if key is not None:
            self._gate = PeerGate(self._ctx, key)
        self._router = WorkerRouter(self._ctx, self.cfg.worker_endpoint, key)
        self._ask_server = AskServer(self._ctx, self.cfg.ask_endpoint, key) if self.cfg.ask_endpoint else None
        if self._gate is not None:
            self._gate.watch(self._router.sock, "workers")
            if self._ask_server is not None:
                self._gate.watch(self._ask_server.sock, "asks")
            self._gate.start()
        self._poller = zmq.Poller()
        self._poller.register(self._router.sock, zmq.POLLIN)
        if self._ask_server:
            self._poller.register(self._ask_server.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _recover(self) -> None:
        """Replay the ledger, then compose the parts around what it gave."""
        rec = recover(self.store)
        self.state, self.recency, self.epoch = rec.state, rec.recency, rec.epoch
        self._writer = self._default_writer(self.store)
        parts = Parts(self.store, self.cfg, rec, self._writer, self._router, self._ask_server, self.traces,
                      self.faults, self.metrics, self._listeners, self._handlers, lambda: self.blocks_in_use(),
                      lambda: self._stop_reason is not None, self.health, lambda w: self.worker_gone(w),
                      self._pool_readers)
        self.recorder, self.checkpoints, self.answers = parts.recorder, parts.checkpoints, parts.answers
        self.anchoring = (Anchoring(self.store, self.cfg.anchor_file, self.cfg.anchor_key_file,
                                    self.cfg.anchor_every_events, rec.last_seq) if self.cfg.anchor_file else None)
        self.awake, self.keep_awake = parts.awake, parts.keep_awake
        self.workers, self.moves, self.asks, self.dial = parts.workers, parts.moves, parts.asks, parts.dial
        self.dial.context_of = lambda w: self.context_of(w)
        self.memory = parts.memory
        self.asks.extra.update(self._ask_handlers)
        if self.groups is not None:       # one decision for the group, every rank's shard moved
            self.asks.expand = self.moves.expand = self.groups.expand
            self.moves.for_policy = self.groups.for_policy
            self.workers.check_group = self.groups.check_hello
            self.dial.ranks_of = lambda w: self.groups.members.get(self.groups.group_of.get(w), [])
        now = time.monotonic_ns()
        self._next = {"ping": now, "policy": now, "watchdog": now, "requery": now, "quiet": now + QUIET_NEVER_NS}
        self.recorder.record(ev.ServerStarted(version=SERVER_VERSION, config_digest=self.cfg.config_digest))
        orphaned = recovery.orphaned_requests(self.state)
        for e in orphaned:
            self.recorder.record(e, correlation=e.request_id)
        if orphaned:
            log.warning("requests_closed_at_start", num_requests=len(orphaned), reason=recovery.CONTROL_LOST)
        for e in flip.stranded_at_recovery(self.state):  # a flip never answered: its arena's image unknown
            self.recorder.record(e, causation="control:recovery")
            log.error("flip_stranded_at_start", flip_id=e.flip_id, stranded_bytes=e.stranded_bytes)
        for e in dial.torn_at_recovery(self.state):     # requested, never answered: its readers unknown
            self.recorder.record(e, causation="control:recovery")
            log.error("rebind_torn_at_start", rebind_id=e.rebind_id, readers=e.readers_behind)
        self.dial.problems = tuple(dial.torn_pools(self.state))
        self._stop_hooks.append(self.dial.stop)
        self.recorder.flush()

    def _close(self) -> None:
        if self.keep_awake is not None:
            self.keep_awake.stop()
        if self._frozen:
            self._frozen = False
            gc.unfreeze()
        for sock in (self._router, self._ask_server):
            if sock is not None:
                sock.close()
        if self._gate is not None:
            self._gate.stop()
        if self._own_ctx:
            self._ctx.destroy(linger=0)
        if self._writer is not None:
            try:
                self._writer.close()
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
        self.recorder.arm(self._wake)
        events = self.awake.poll(self._poller, now, timeout_ms)
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
                if not self.workers.recv():
                    break
        if self._ask_server is not None and self._ask_server.sock in events:
            for _ in range(64):
                if not self.asks.recv():
                    break

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "ask":
                _, ask, asker, reply, off_loop = item
                self.asks.handle(ask, asker, reply, off_loop)
            elif kind == "call":
                _, fn, fut = item
                try:
                    fut.set_result(fn(self))
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    fut.set_exception(e)
            elif kind == "exited":
                self.workers.exited(*item[1:])

    def _commits(self) -> bool:
        """Send the commands and answers whose events are committed; True when any went."""
        committed = self.recorder.advance()
        acted = False
        for req in self.moves.book.committed(committed):
            self.moves.dispatch(req)
            acted = True
        if acted:      # their MoveDispatched rows, after the commands have left (never before)
            self.recorder.flush()
        acted = self.answers.send_committed(committed) or acted
        self.checkpoints.save_committed(committed)
        if self.anchoring is not None:
            self.anchoring.committed(committed)
        return acted

    def _serve_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """At stop: the loop without its ticks, until ``done()`` or the timeout."""
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._poll()
            self.recorder.flush()
            self._commits()

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
            self.asks.watch_commits()
            self.memory.tick(now)
            self.moves.watch_deadlines()
            self.dial.watch()
        if now >= nxt["ping"]:
            nxt["ping"] = now + int(self.cfg.ping_interval_s * S)
            self.workers.heartbeats(now)
        if now >= nxt["requery"]:
            nxt["requery"] = now + int(self.cfg.requery_interval_s * S)
            self.moves.requery()
        if now >= nxt["policy"]:
            period = int(self.cfg.policy_interval_s * S)
            due = self._policy_due = self._policy_due or nxt["policy"]
            if wait and now - due < period:
                nxt["policy"] = now + MS
            else:
                self._policy_due = 0
                nxt["policy"] = now + period
                if not self.workers.adopting:
                    self.moves.run_policies()
        due = self.checkpoints.due(now, quiet=not wait)
        if due == "now":
            self.checkpoints.take(now)
        elif due == "quiet":
            nxt["quiet"] = now + MS
