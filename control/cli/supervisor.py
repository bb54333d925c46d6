"""The worker processes of `residency serve`: how many, on which device, and a supervisor that
starts the ones the control process is missing and tells it when one exits."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import structlog

from residency.control.cli.main import UserError
from residency.events.handshake import SIZING_REFUSED_EXIT, refused_file

log = structlog.get_logger("control.serve")


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch (seconds) in the control process."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def plan_workers(args) -> list[str]:
    """The device of each worker, in worker order."""
    gpus = visible_gpus() if args.device in ("auto", "cuda") else 0
    if args.device == "cuda" and gpus == 0:
        raise UserError("--device cuda: no GPU is visible to this process")
    n = args.workers or max(gpus, 1)
    if gpus and args.device != "cpu":
        return [f"cuda:{i % gpus}" for i in range(n)]
    return ["cpu"] * n


class WorkerChild:
    __slots__ = ("worker", "epoch", "popen", "started", "joined")

    def __init__(self, worker: int, epoch: int, popen: subprocess.Popen):
        self.worker, self.epoch, self.popen, self.started = worker, epoch, popen, time.monotonic()
        self.joined = False


class Supervisor:
    """Starts the workers the control process is missing; reports the exit of each one it started.

    A worker that does not join within ``join_timeout_s`` is killed and started again; a worker
    restarted ``max_restarts`` times within ``window_s`` is left down (logged: a crash loop is not
    hidden behind restarts).
    """

    def __init__(self, proc, argv_for, run_dir: Path, join_timeout_s: float = 120.0, max_restarts: int = 5,
                 window_s: float = 60.0):
        self.proc = proc
        self.argv_for = argv_for
        self.run_dir = run_dir
        self.join_timeout_s = join_timeout_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self.children: dict[int, WorkerChild] = {}
        self.starts: dict[int, list[float]] = {}
        self.gave_up: set[int] = set()
        self.adopted_gone: set[tuple[int, int]] = set()     # (worker, epoch) reported exited
        # a worker that could not size its device pool: the arithmetic it left (the server stops)
        self.refused: str | None = None

    def tick(self) -> None:
        for w, child in list(self.children.items()):
            rc = child.popen.poll()
            if rc is not None:
                del self.children[w]
                if rc == SIZING_REFUSED_EXIT:
                    self._refused(w)
                log.warning("worker_exited", worker=w, epoch=child.epoch, returncode=rc)
                self.proc.worker_exited(w, child.epoch, rc)
        if self.refused:
            return          # a pool that does not fit will not fit on a restart either
        self._watch_adopted()
        missing = self.proc.call(lambda p: p.missing_workers()).result(timeout=10)
        for w, child in self.children.items():
            child.joined = child.joined or w not in missing
        now = time.monotonic()
        for w in missing:
            child = self.children.get(w)
            if child is not None:
                if now - child.started > self.join_timeout_s:
                    log.warning("worker_never_joined", worker=w, epoch=child.epoch, seconds=round(now - child.started))
                    child.popen.kill()
                continue
            recent = [t for t in self.starts.get(w, []) if now - t < self.window_s]
            if len(recent) >= self.max_restarts:
                if w not in self.gave_up:
                    self.gave_up.add(w)
                    log.error("worker_restart_limit", worker=w, restarts=len(recent), window_s=self.window_s)
                continue
            self.start(w)

    def _refused(self, w: int) -> None:
        try:
            why = refused_file(self.run_dir, w).read_text().strip()
        except OSError as e:
            why = f"worker {w} exited {SIZING_REFUSED_EXIT} without its arithmetic ({e.strerror})"
        self.refused = self.refused or f"worker {w}: {why}"
        log.error("worker_refused_pool", worker=w, detail=why)

    def _watch_adopted(self) -> None:
        """A worker adopted after a control restart is not our child, so its exit is not ours to
        wait for: its pid file names its process, and a process that is gone is reported exited
        as a child's would be (its disk copies then wait for the next incarnation instead of being
        dropped after a heartbeat silence)."""
        for pid_file in self.run_dir.glob("worker-*.pid"):
            try:
                w = int(pid_file.stem.split("-", 1)[1])
                pid_s, epoch_s = pid_file.read_text().split()[:2]
                pid, epoch = int(pid_s), int(epoch_s)
            except (OSError, ValueError, IndexError):
                continue
            if w in self.children or (w, epoch) in self.adopted_gone or not _gone(pid):
                continue
            self.adopted_gone.add((w, epoch))
            log.warning("worker_exited", worker=w, epoch=epoch, pid=pid, adopted=True)
            self.proc.worker_exited(w, epoch, None)

    def start(self, w: int) -> None:
        epoch = time.time_ns() // 1000
        popen = subprocess.Popen(self.argv_for(w, epoch), start_new_session=True, stdin=subprocess.DEVNULL)
        self.children[w] = WorkerChild(w, epoch, popen)
        self.starts.setdefault(w, []).append(time.monotonic())
        log.info("worker_starting", worker=w, epoch=epoch, pid=popen.pid)

    def stop(self, timeout_s: float = 15.0) -> bool:
        """After the control process told the workers to stop: wait for them, then make sure.
        A worker still starting never heard the Shutdown: it is terminated at once. True: none is
        left alive."""
        for c in self.children.values():
            if not c.joined and c.popen.poll() is None:
                c.popen.terminate()
        pids = {c.popen.pid for c in self.children.values()}
        for pid_file in self.run_dir.glob("worker-*.pid"):     # workers adopted after a crash
            try:
                pids.add(int(pid_file.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        deadline = time.monotonic() + timeout_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for pid in list(pids):
                if sig is not None:
                    try:
                        os.kill(pid, sig)
                        log.warning("worker_signalled", pid=pid, signal=sig.name)
                    except ProcessLookupError:
                        pass
            while pids and time.monotonic() < deadline:
                for c in self.children.values():
                    c.popen.poll()
                pids = {pid for pid in pids if _alive(pid)}
                time.sleep(0.05)
            if not pids:
                return True
            deadline = time.monotonic() + 3.0
        return False


def _gone(pid: int) -> bool:
    """The process is gone, or a zombie nobody reaped (a container's first process may not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a child of ours that exited is a zombie until reaped
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True
