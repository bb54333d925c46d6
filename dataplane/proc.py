"""A data-plane worker process: ``python -m residency.dataplane.proc --worker N --control ipc://... --device cpu``.

Two threads, two sockets:

    I/O thread (main)   DEALER to the control process. Answers Ping and QueryMoves at once, even
                        while a large move runs; says Hello; watches for a silent control.
    engine thread       the only thread that touches the engine: runs commands in arrival order.
                        (Side threads run commands that touch no engine state, such as Tokenize,
                        beside it: dataplane/side.py.)
                        It owns the engine lane, a second DEALER (``--lane``, the default): the
                        engine's commands arrive there and their replies leave from there, so a
                        move's command and its ack each skip a hand-over between the threads
                        (a wake of a sleeping thread: ~0.1 ms each way on an idle host).
                        Its loop with the lane is dataplane/lane.py.

Without the lane (``--no-lane``, or any fault hook on replies: they run on the I/O thread's timers)
the I/O thread hands every command to the engine thread and sends what comes back, as before.

    start:  Hello{worker, epoch, device, tiers, block_bytes}
    loop:   commands in ─► engine thread ─► replies out
            control silent > control_silent_s ─► Hello again (a restarted control adopts us)
            control silent > orphan_exit_s    ─► exit (nobody will ever ask for our memory again)
    stop:   Shutdown or SIGTERM ─► finish the command running, close the engine, exit 0

The process is started in its own session by ``residency serve`` so a terminal's Ctrl-C reaches
only the control process, which stops the workers by message after freeing their memory by the book.
"""
from __future__ import annotations

import argparse
import gc
import heapq
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec
import structlog
import zmq

from residency.dataplane.serving_worker import add_serving_args
from residency.dataplane.lane import EngineLane
from residency.dataplane.side import SideThreads
from residency.dataplane.transport import UNEXPECTED, ControlLink, WorkerTransportError, lane_identity_of
from residency.dataplane.worker import OUTCOMES, NoCopyEngine, WorkerCore, WorkerFaults, WorkerRecord, command_ref
from residency.events import affinity
from residency.events.codec import encode_message
from residency.events.commands import (
    BlocksReleased, CommandAhead, ErrorReply, ExecuteMove, Hello, MoveTimed, Ping, Pong, QueryMoves, ReleaseBlocks, Shutdown,
)
from residency.dataplane.logconfig import configure_worker_logging

log = structlog.get_logger("dataplane.proc")
MS = 1_000_000
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class WorkerProc(EngineLane, SideThreads):
    def __init__(self, *, worker: int, epoch: int, endpoint: str, core: WorkerCore, device: str, block_bytes: int,
                 faults: WorkerFaults, control_silent_s: float = 1.0, orphan_exit_s: float = 60.0,
                 report_timings: bool = False, lane: bool = True, ctx: zmq.Context | None = None,
                 cpu: int | None = None, nearly_done: bool = True, awake_for_commands: bool = True,
                 start_ahead: bool = True, early_ack: bool = True):
        self.worker, self.epoch, self.endpoint = worker, epoch, endpoint
        self.core, self.device, self.block_bytes = core, device, block_bytes
        self.faults = faults
        self.control_silent_ns = int(control_silent_s * 1e9)
        self.orphan_exit_ns = int(orphan_exit_s * 1e9)
        # the engine thread and the ZMQ I/O thread on one CPU (events/affinity.py); None: unplaced
        self.cpu = cpu
        self.ctx = ctx or affinity.context_on(cpu)
        self.nearly_done = nearly_done          # the lane sends MoveNearlyDone before a big move's last chunk
        self.awake_for_commands = awake_for_commands    # the lane polls awake on a CommandAhead
        self._awake_until = 0                   # monotonic ns; the engine thread's
        self.start_ahead = start_ahead          # a CommandAhead carrying its command starts the copies
        self._ahead_until = 0                   # monotonic ns: an early-started move is abandoned then
        self._ahead_read_ns = 0                 # wall ns: its CommandAhead was read
        # the lane sends a move's outcome as soon as the engine has it, before the engine's own
        # bookkeeping after it (lane.py); not with fault hooks, whose kills and delays are placed
        # between a move and its ack
        self.early_ack = early_ack and not faults.enabled
        self.record = WorkerRecord(worker)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # the engine lane: off when a fault hook holds or rewrites replies (see the module's doc)
        self.lane_mode = lane and not faults.on_replies
        self._engine_wake_r, self._engine_wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lane_hello_due = False
        self._delayed: list[tuple[int, int, bytes]] = []     # (due monotonic ns, n, payload)
        self._held: tuple[bytes, int] | None = None           # a reordered ack and when it must go
        self._n = 0
        self._stop: str | None = None
        self._last_control_ns = time.monotonic_ns()
        self._last_hello_ns = 0
        self._silent_logged = False
        # --report-timings: move_id -> [received, queued] (wall ns), completed by the engine thread's
        # marks and sent as MoveTimed after the outcome (benchmarks' breakdown)
        self.report_timings = report_timings
        self._timings: dict[str, list[int]] = {}
        self._recv_ns = self._sent_ns = 0
        self.log = log.bind(worker=worker, epoch=epoch)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        self.link = ControlLink(self.ctx, self.endpoint, self.worker)
        engine_thread = threading.Thread(target=self._lane_loop if self.lane_mode else self._engine_loop,
                                         name="engine", daemon=True)
        engine_thread.start()
        side_threads = self._start_side()
        poller = zmq.Poller()
        poller.register(self.link.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._hello()
        self.log.info("worker_started", endpoint=self.endpoint, device=self.device, faults=self.faults.enabled)
        try:
            while self._stop is None:
                ready = dict(poller.poll(self._timeout_ms()))
                if self._wake_r in ready:
                    self._drain_wake()
                self._send_results()
                if self.link.sock in ready:
                    for _ in range(1024):
                        if not self._recv():
                            break
                self._timers()
        finally:
            self._to_engine(None)
            engine_thread.join(timeout=30)
            self._stop_side(side_threads)
            self._send_results()
            try:
                self.core.engine.close()
            except Exception as e:  # noqa: BLE001 - logged once, the process is ending anyway
                self.log.warning("engine_close_failed", error=repr(e))
            self.link.close()
            self.log.info("worker_stopped", reason=self._stop, faults=self.faults.counts)
        return 0

    def stop(self, reason: str) -> None:
        if self._stop is None:
            self._stop = reason
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _hello(self) -> None:
        self._last_hello_ns = time.monotonic_ns()
        lane = lane_identity_of(self.worker).decode() if self.lane_mode else None
        self.link.send(Hello(worker=self.worker, epoch=self.epoch, device=self.device,
                             tiers=dict(self.core.engine.capacities()), block_bytes=self.block_bytes, lane=lane,
                             disk_blocks=list(self.core.unclaimed_disk)))
        for msg in self.core.hello_extras():     # e.g. ServingReady: the control learns the model again
            self.link.send(msg)
        if self.lane_mode:       # after each Hello the lane says it is up (a restarted control learns it)
            self._lane_hello_due = True
            self._wake_engine()

    def _to_engine(self, cmd) -> None:
        self._jobs.put(cmd)
        self._wake_engine()

    def _wake_engine(self) -> None:
        if not self.lane_mode:
            return          # the engine thread waits on the queue itself
        try:
            os.write(self._engine_wake_w, b"x")
        except OSError:
            pass      # full: it wakes anyway

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        affinity.pin_this_thread(self.cpu)
        while True:
            bg = self.core.background
            if bg is not None and bg[0]():
                try:
                    cmd = self._jobs.get_nowait()
                except queue.Empty:       # no command waits: one step of background work (serving)
                    self._background_step(bg[1])
                    continue
            else:
                cmd = self._jobs.get()
            if cmd is None:
                return
            self._run_handed(cmd)

    def _run_core(self, cmd, run=None) -> list:
        """``run(cmd)`` (default ``core.run``); a handler that raises is answered by name."""
        try:
            return (run or self.core.run)(cmd)
        except Exception as e:  # noqa: BLE001 - a bug in a handler must not kill the worker
            self.log.error("command_raised", type=type(cmd).__name__, ref=command_ref(cmd), error=repr(e), exc_info=True)
            return [ErrorReply(error="command_raised", detail=f"{type(cmd).__name__} {command_ref(cmd)}: {e!r}")]

    def _run_handed(self, cmd) -> None:
        """A command the I/O thread handed over: run it; the I/O thread sends its replies."""
        t0 = time.time_ns()
        replies = self._run_core(cmd)
        self._hand_back(cmd, replies, (t0, time.time_ns()))

    def _hand_back(self, cmd, replies: list, engine_ns: tuple[int, int] | None) -> None:
        """Replies made off the I/O thread (engine or side thread): the I/O thread sends them."""
        self._results.put((cmd, replies, engine_ns))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass      # the pipe is full: the I/O thread wakes anyway

    def _run_step(self, step) -> list:
        """One step of background work (serving); its replies, or the error it raised, named."""
        try:
            return step() or []
        except Exception as e:  # noqa: BLE001 - a bug in the serving loop must not kill the worker
            self.log.error("background_step_raised", error=repr(e), exc_info=True)
            return [ErrorReply(error="background_step_raised", detail=repr(e))]

    def _background_step(self, step) -> None:
        replies = self._run_step(step)
        if replies:
            self._hand_back(None, replies, None)

    # ------------------------------------------------------------------ I/O thread
    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _recv(self) -> bool:
        self._recv_ns = time.time_ns()
        try:
            cmd = self.link.recv()
        except zmq.Again:
            return False
        except WorkerTransportError as e:
            self.log.warning("bad_control_message", error=e.name, detail=e.detail)
            self.link.send(ErrorReply(error=e.name, detail=e.detail))
            return True
        self._last_control_ns = time.monotonic_ns()
        self._silent_logged = False
        t = type(cmd)
        if t is Ping:
            self.link.send(Pong(worker=self.worker, nonce=cmd.nonce, ts_ns=time.time_ns()))
        elif t is QueryMoves:
            self.link.send(self.record.report(cmd.move_ids))
        elif t is Shutdown:
            self.log.info("shutdown_asked", reason=cmd.reason)
            self.stop(f"asked: {cmd.reason}")
        elif t is ErrorReply:
            self._on_error(cmd)
        elif t is CommandAhead:
            pass            # a hint for the engine lane; this thread has nothing to wait for
        elif t is ExecuteMove or t is ReleaseBlocks:
            ref = command_ref(cmd)
            verdict, replies = self.record.claim(ref)
            if verdict == self.record.DUPLICATE:     # a duplicate command: the same answer again
                for r in replies:
                    self.link.send(r)
            elif verdict == self.record.TOMBSTONED:
                self.log.warning("tombstoned_command_refused", ref=ref)
                self._send_replies(cmd, self.record.refusal(cmd))
            elif verdict == self.record.NEW:
                if self.report_timings:
                    self._timings[ref] = [self._recv_ns, time.time_ns()]
                self._to_engine(cmd)
        elif t in self.core.side_handlers:
            self._to_side(cmd)
        elif t in self.core.handlers:
            self._to_engine(cmd)
        else:
            self.link.send(ErrorReply(error=UNEXPECTED, detail=f"{t.__name__} has no handler on this worker"))
        return True

    def _on_error(self, err: ErrorReply) -> None:
        if err.error == "unknown_worker":
            if time.monotonic_ns() - self._last_hello_ns > 200 * MS:
                self.log.info("control_does_not_know_us", detail=err.detail)
                self._hello()
        else:
            self.log.warning("control_error", error=err.error, detail=err.detail)

    def _send_results(self) -> None:
        while True:
            try:
                cmd, replies, engine_ns = self._results.get_nowait()
            except queue.Empty:
                return
            self._send_replies(cmd, replies)
            marks = self._timings.pop(command_ref(cmd), None) if self._timings and cmd is not None else None
            if marks is not None and engine_ns is not None:
                self.link.send(MoveTimed(move_id=command_ref(cmd), worker=self.worker, received_ns=marks[0],
                                         queued_ns=marks[1], engine_start_ns=engine_ns[0],
                                         engine_end_ns=engine_ns[1], sent_ns=self._sent_ns))

    def _send_replies(self, cmd, replies: list) -> None:
        silent = False
        if type(cmd) is ReleaseBlocks and replies and type(replies[0]) is BlocksReleased:
            if self.faults.roll("zero_release"):
                replies = [msgspec.structs.replace(replies[0], bytes_freed=0)]
            silent = self.faults.roll("silent_release")
        if type(cmd) in (ExecuteMove, ReleaseBlocks):
            self.record.note(command_ref(cmd), replies, time.time_ns())
        if silent:
            self.log.warning("fault_silent_release", ref=command_ref(cmd))
            return
        for r in replies:
            if isinstance(r, OUTCOMES):
                payload = encode_message(r)
                self._sent_ns = time.time_ns()
                self._emit_outcome(payload)
            else:
                self.link.send(r)

    def _emit_outcome(self, payload: bytes) -> None:
        f = self.faults
        if not f.enabled:
            self.link.send_bytes(payload)
            return
        now = time.monotonic_ns()
        if f.roll("drop_ack"):
            return
        delay = f.roll_delay_s()
        if delay:
            self._n += 1
            heapq.heappush(self._delayed, (now + int(delay * 1e9), self._n, payload))
            return
        if self._held is None and f.roll("reorder_ack"):
            self._held = (payload, now + 500 * MS)
            return
        self.link.send_bytes(payload)
        if f.roll("duplicate_ack"):
            self.link.send_bytes(payload)
        if self._held is not None:
            self.link.send_bytes(self._held[0])
            self._held = None

    def _timeout_ms(self) -> int:
        due = [self._delayed[0][0]] if self._delayed else []
        if self._held:
            due.append(self._held[1])
        if not due:
            return 100
        return max(0, min(due) - time.monotonic_ns()) // MS

    def _timers(self) -> None:
        now = time.monotonic_ns()
        while self._delayed and self._delayed[0][0] <= now:
            self.link.send_bytes(heapq.heappop(self._delayed)[2])
        if self._held is not None and self._held[1] <= now:
            self.link.send_bytes(self._held[0])
            self._held = None
        silent = now - self._last_control_ns
        if silent > self.orphan_exit_ns:
            self.log.warning("control_gone", silent_ms=silent // MS)
            self.stop(f"control silent for {silent // MS} ms")
        elif silent > self.control_silent_ns:
            if not self._silent_logged:
                self._silent_logged = True
                self.log.warning("control_silent", silent_ms=silent // MS)
            if now - self._last_hello_ns > self.control_silent_ns:
                self._hello()


# ---------------------------------------------------------------------- building the engine
def parse_layout(spec: str) -> tuple[int, int, int, int, str]:
    """"num_layers,page_tokens,num_kv_heads,head_dim,dtype", e.g. "30,16,3,64,bfloat16"."""
    parts = spec.split(",")
    if len(parts) != 5 or parts[4] not in DTYPE_BYTES:
        raise ValueError(f"--kv-layout {spec!r}: want num_layers,page_tokens,num_kv_heads,head_dim,dtype "
                         f"(dtype one of {sorted(DTYPE_BYTES)})")
    return int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4]


def layout_block_bytes(layout: tuple[int, int, int, int, str]) -> int:
    layers, page, heads, dim, dtype = layout
    return layers * 2 * page * heads * dim * DTYPE_BYTES[dtype]


def build_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    if args.engine == "real" and getattr(args, "model", None) not in (None, "", "none"):
        from residency.dataplane.serving_worker import build_serving_core  # noqa: PLC0415 - the model sets the layout
        return build_serving_core(args, faults)
    layout = parse_layout(args.kv_layout)
    block_bytes = layout_block_bytes(layout)
    if args.engine == "nocopy":
        caps = {"device": args.device_blocks * block_bytes, "host": args.host_bytes, "disk": args.disk_bytes}
        return WorkerCore(NoCopyEngine(block_bytes, caps, args.worker, args.device), args.worker, faults), block_bytes
    import torch  # noqa: PLC0415 - only the real engine needs it (and its seconds of import)

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    kv = KVLayout(*layout[:4], dtype=layout[4])
    pinned = Mover.pinned_bytes_needed(kv, args.device_blocks, args.host_bytes)
    engine = Mover(kv, args.device_blocks, args.host_bytes, disk_dir, pinned, args.device, worker=args.worker,
                    disk_bytes=args.disk_bytes, fsync=args.disk_fsync)
    return WorkerCore(engine, args.worker, faults, expected_errors=(DataPlaneError,)), kv.block_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m residency.dataplane.proc", description="A Residency data-plane worker.")
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--epoch", type=int, default=0, help="this incarnation (default: now in µs)")
    p.add_argument("--control", required=True, help="the control process's worker endpoint (ipc:// or tcp://)")
    p.add_argument("--run-dir", required=True, help="pid file and disk tier live here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", choices=("real", "nocopy"), default="real",
                   help="nocopy keeps block tables only (benchmarks of the control plane); never for serving")
    p.add_argument("--kv-layout", default="30,16,3,64,bfloat16", help="num_layers,page_tokens,num_kv_heads,head_dim,dtype")
    p.add_argument("--device-blocks", type=int, default=1024)
    p.add_argument("--host-bytes", type=int, default=1 << 30)
    p.add_argument("--disk-bytes", type=int, default=4 << 30)
    p.add_argument("--disk-fsync", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--keep-disk", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the disk tier's files of an earlier incarnation: rebuilt, verified, offered in Hello")
    p.add_argument("--torch-threads", type=int, default=0)
    p.add_argument("--faults", default=os.environ.get("RESIDENCY_WORKER_FAULTS", ""),
                   help="fault hooks for tests (see dataplane.worker.WorkerFaults); off by default")
    p.add_argument("--control-silent-s", type=float, default=1.0)
    p.add_argument("--orphan-exit-s", type=float, default=60.0)
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="run each move path once on scratch blocks before Hello (default: on a GPU)")
    p.add_argument("--lane", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine thread's own socket for the engine's commands and replies (default on)")
    p.add_argument("--cpu", type=int, default=None,
                   help="run the engine thread and the ZMQ I/O thread on this CPU (events/affinity.py; GPU workers)")
    p.add_argument("--nearly-done", action=argparse.BooleanOptionalAction, default=True,
                   help="on the lane, tell the control when a big move's last chunk is crossing (default on)")
    p.add_argument("--awake-for-commands", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CommandAhead, the lane polls awake until the command comes (default on)")
    p.add_argument("--start-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CommandAhead that carries its command, begin the copies before the command "
                        "comes; nothing is visible until it does (default on)")
    p.add_argument("--early-ack", action=argparse.BooleanOptionalAction, default=True,
                   help="on the lane, send a move's outcome as soon as the engine has it, before the "
                        "engine's bookkeeping after it (default on; off with --faults)")
    p.add_argument("--report-timings", action="store_true",
                   help="after each move's outcome send MoveTimed (where its time went here); benchmarks")
    add_serving_args(p)
    args = p.parse_args(argv)
    configure_worker_logging()
    epoch = args.epoch or time.time_ns() // 1000
    structlog.contextvars.bind_contextvars(proc=f"worker:{args.worker}")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pid_path = run_dir / f"worker-{args.worker}.pid"
    pid_path.write_text(f"{os.getpid()} {epoch}\n")
    faults = WorkerFaults(args.faults)
    if faults.enabled:
        log.warning("worker_faults_enabled", worker=args.worker, faults=args.faults)
    core, block_bytes = build_core(args, faults)
    warm = args.warm_up if args.warm_up is not None else args.device.startswith("cuda")
    if warm and hasattr(core.engine, "warm_up"):     # before Hello: the first move pays no kernel compile
        did = core.engine.warm_up()
        log.info("engine_warmed_up", worker=args.worker, blocks=did["blocks"], ms=round(1e3 * did["seconds"], 1))
    # NOTE: what exists now (torch, the engine, its pools and tables) lives as long as this process:
    # frozen out of the collector, a full collection scans only what came after (with torch
    # imported a full collection of everything takes ~90 ms, a pause between a command and its ack).
    gc.collect()
    gc.freeze()
    proc = WorkerProc(worker=args.worker, epoch=epoch, endpoint=args.control, core=core, device=args.device,
                      block_bytes=block_bytes, faults=faults, control_silent_s=args.control_silent_s,
                      orphan_exit_s=args.orphan_exit_s, report_timings=args.report_timings,
                      lane=args.lane, cpu=args.cpu, nearly_done=args.nearly_done,
                      awake_for_commands=args.awake_for_commands, start_ahead=args.start_ahead,
                      early_ack=args.early_ack)
    signal.signal(signal.SIGTERM, lambda *_: proc.stop("SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # serve stops us by message, after freeing by the book
    try:
        return proc.run()
    finally:
        try:
            if pid_path.read_text().split()[0] == str(os.getpid()):
                pid_path.unlink()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
