"""A data-plane worker process: ``python -m residency.dataplane.proc --worker N --control ipc://... --device cpu``.

Three kinds of thread, two sockets to the control process:

    I/O thread (main)   the Hello socket: says Hello, answers Ping and QueryMoves at once even
                        while a large move runs, watches for a silent control (dataplane/io_thread.py)
    device thread       the only thread that touches the mover and the model; runs commands in
                        arrival order, with a socket of its own, the lane (dataplane/device_thread.py)
    side threads        commands that touch neither, such as Tokenize (dataplane/side.py)

    start:  Hello{worker, epoch, device, tiers, block_bytes, lane}, then LaneHello on the lane
    loop:   commands in ─► the device thread ─► replies out
    stop:   Shutdown or SIGTERM ─► finish the command running, close the mover, exit 0

The process is started in its own session by ``residency serve`` so a terminal's Ctrl-C reaches
only the control process, which stops the workers by message after freeing their memory by the book.
"""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import zmq

from residency.dataplane.build import build_core
from residency.dataplane.device_thread import AfterMove, DeviceThread
from residency.dataplane.faults import WorkerFaults, rank_faults
from residency.dataplane.group import add_group_args
from residency.dataplane.io_thread import IOThread, Mailbox
from residency.dataplane.logconfig import configure_worker_logging
from residency.dataplane.serving_worker import add_serving_args
from residency.dataplane.sizing import PoolSizingRefused, StartRefused
from residency.dataplane.side import SideThreads
from residency.dataplane.worker import WorkerCore, WorkerRecord, run_guarded
from residency.events.handshake import SIZING_REFUSED_EXIT, PeerKeyError, key_in, refused_file

log = structlog.get_logger("dataplane.proc")


class WorkerProc:
    """A worker's threads around its core, and the I/O thread's loop."""

    def __init__(self, *, worker: int, epoch: int, endpoint: str, core: WorkerCore, device: str, block_bytes: int,
                 faults: WorkerFaults, control_silent_s: float = 1.0, orphan_exit_s: float = 60.0,
                 ctx: zmq.Context | None = None, after_move: AfterMove | None = None, key: bytes | None = None):
        self.core, self.faults = core, faults
        self.log = log.bind(worker=worker, epoch=epoch)
        ctx = ctx or zmq.Context.instance()
        record = WorkerRecord(worker)
        mailbox = Mailbox()
        self.device = DeviceThread(core=core, record=record, faults=faults, ctx=ctx, endpoint=endpoint, worker=worker,
                                   epoch=epoch, hand_back=mailbox.put, after_move=after_move, key=key)
        self.side = SideThreads(core.side_handlers, run_guarded, mailbox.put)
        self.io = IOThread(worker=worker, epoch=epoch, device=device, block_bytes=block_bytes, ctx=ctx,
                           endpoint=endpoint, core=core, record=record, faults=faults, device_thread=self.device,
                           side=self.side, mailbox=mailbox, control_silent_s=control_silent_s,
                           orphan_exit_s=orphan_exit_s, key=key)

    def run(self) -> int:
        self.device.start()
        self.side.start()
        self.io.open()
        self.log.info("worker_started", endpoint=self.io.endpoint, device=self.io.device, faults=self.faults.enabled)
        try:
            while self.io.stop_reason is None:
                if self.io.wait():           # the socket, the mailbox, or a timer
                    self.io.read()           # answered here, or handed to the device or side threads
                self.io.send_handed_back()   # their replies
                self.io.tick()               # held outcomes, heartbeats, silence
        finally:
            self.device.stop()
            self.side.stop()
            self.io.send_handed_back()
            try:
                self.core.close()
            except Exception as e:  # noqa: BLE001 - logged once, the process is ending anyway
                self.log.warning("mover_close_failed", error=repr(e))
            self.io.close()
            self.log.info("worker_stopped", reason=self.io.stop_reason, faults=self.faults.counts)
        return 0

    def stop(self, reason: str) -> None:
        self.io.stop(reason)


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m residency.dataplane.proc", description="A Residency data-plane worker.")
    p.add_argument("--worker", type=int, required=True, help="this worker's number")
    p.add_argument("--epoch", type=int, default=0, help="this incarnation (default: now in µs)")
    p.add_argument("--control", required=True, help="the control process's worker endpoint (ipc:// or tcp://)")
    p.add_argument("--run-dir", required=True, help="pid file and disk tier live here")
    p.add_argument("--device", default="cpu", help="the torch device of the device tier (cpu, cuda:N)")
    p.add_argument("--kv-layout", default="30,16,3,64,bfloat16", help="num_layers,page_tokens,num_kv_heads,head_dim,dtype")
    p.add_argument("--device-blocks", type=int, default=None,
                   help="blocks in the device pool (default: sized from --gpu-memory-fraction after the weights load)")
    p.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="the most of the device's memory this worker may take in all (default: 0.8 of a CUDA "
                        "card, 0.2 of the RAM free at start on a CPU host)")
    p.add_argument("--host-bytes", type=int, default=1 << 30, help="bytes of the pinned host tier")
    p.add_argument("--disk-bytes", type=int, default=4 << 30, help="bytes of the disk tier")
    p.add_argument("--disk-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="fsync each disk write before it is acked")
    p.add_argument("--keep-disk", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the disk tier's files of an earlier incarnation: rebuilt, verified, offered in Hello")
    p.add_argument("--torch-threads", type=int, default=0, help="torch's CPU threads (0: torch's default)")
    p.add_argument("--faults", default=os.environ.get("RESIDENCY_WORKER_FAULTS", ""),
                   help="fault hooks for tests (see dataplane.faults.WorkerFaults); off by default")
    p.add_argument("--control-silent-s", type=float, default=1.0, help="say Hello again after this much silence")
    p.add_argument("--orphan-exit-s", type=float, default=60.0, help="exit after this much silence from the control")
    add_serving_args(p)
    add_group_args(p)
    return p


def main(argv: list[str] | None = None,
         build: Callable[[argparse.Namespace, WorkerFaults], tuple[WorkerCore, int]] = build_core,
         after_move: AfterMove | None = None) -> int:
    """Run a worker; ``build(args, faults)`` makes its core and block size. A bench's worker
    (bench/worker.py) passes its own ``build`` and ``after_move`` (dataplane/device_thread.py)."""
    args = arg_parser().parse_args(argv)
    configure_worker_logging()
    epoch = args.epoch or time.time_ns() // 1000
    structlog.contextvars.bind_contextvars(proc=f"worker:{args.worker}")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:    # the control's peer key, proven in both sockets' handshakes (none: the control has none)
        key = key_in(run_dir)
    except PeerKeyError as e:
        log.error("worker_peer_key_refused", worker=args.worker, error=str(e))
        return 2
    pid_path = run_dir / f"worker-{args.worker}.pid"
    pid_path.write_text(f"{os.getpid()} {epoch}\n")
    faults = WorkerFaults(rank_faults(args.faults, args.rank))
    if faults.enabled:
        log.warning("worker_faults_enabled", worker=args.worker, faults=args.faults)
    try:
        core, block_bytes = build(args, faults)
    except (PoolSizingRefused, StartRefused) as e:
        # the server stops with these numbers: its supervisor reads the file when we exit so
        log.error("device_pool_refused", worker=args.worker, detail=str(e))
        refused_file(run_dir, args.worker).write_text(str(e) + "\n")
        pid_path.unlink(missing_ok=True)
        return SIZING_REFUSED_EXIT
    # A GPU worker runs each move path once on scratch blocks before Hello, so its first real move
    # pays no kernel compile or first-touch cost; a CPU worker has none to pay.
    if args.device.startswith("cuda") and hasattr(core.mover, "warm_up"):
        did = core.mover.warm_up()
        log.info("mover_warmed_up", worker=args.worker, blocks=did["blocks"], ms=round(1e3 * did["seconds"], 1))
    # NOTE: what exists now (torch, the mover, its pools and tables) lives as long as this process:
    # frozen out of the collector, a full collection scans only what came after (with torch
    # imported, a full collection of everything is a long pause between a command and its ack).
    gc.collect()
    gc.freeze()
    proc = WorkerProc(worker=args.worker, epoch=epoch, endpoint=args.control, core=core, device=args.device,
                      block_bytes=block_bytes, faults=faults, control_silent_s=args.control_silent_s,
                      orphan_exit_s=args.orphan_exit_s, after_move=after_move, key=key)
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
