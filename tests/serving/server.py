"""A real ``residency serve`` subprocess on a free port with a temporary SQLite ledger."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *extra: str, name: str = "serve", ledger: str | None = None,
                 device_blocks: int | None = 192, faults: str | None = None):
        """``faults``: the workers' ``RESIDENCY_WORKER_FAULTS`` for this server alone (None: as the
        test process has it)."""
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ledger = ledger or f"sqlite:///{self.dir / 'ledger.db'}"
        self.log_path = self.dir / "serve.log"
        argv = [sys.executable, "-m", "residency.control.cli.main", "serve", "--ledger", self.ledger, "--port", str(self.port),
                "--run-dir", str(self.dir / "run"),
                *(("--device-blocks", str(device_blocks)) if device_blocks is not None else ()), "--host-bytes", "256MiB",
                "--disk-bytes", "512MiB", "--no-disk-fsync", "--admin-key", ADMIN_KEY, *extra]
        # One torch thread in the worker (as the control-plane tests' workers run, --torch-threads 1):
        # on a 2-core host shared with pytest, the control process and often a second server,
        # OpenMP's spinning barriers made model loads and steps slower with two. OMP_NUM_THREADS
        # set by the caller wins.
        env = dict(os.environ, RESIDENCY_LOG_FORMAT="json", RESIDENCY_WORKER_LOG_LEVEL="info",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        if faults is not None:
            env["RESIDENCY_WORKER_FAULTS"] = faults
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 180.0, model: str = MODEL) -> "Server":
        """Wait until /v1/models lists ``model``; the server exiting first, or the timeout, raises."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"residency serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=2)
                if r.status_code == 200 and any(m["id"] == model for m in r.json()["data"]):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"residency serve not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def admin(self, method: str, path: str, key: str | None = ADMIN_KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kw)


def read_ledger(url: str):
    """(recorded events, state folded from zero) of a ledger no server is writing any more."""
    from residency.control.replay import replay
    from residency.ledger import LedgerStore

    store = LedgerStore.open(url)
    try:
        state, _ = replay(store, use_snapshots=False)
        events = list(store.read(1, state.last_seq))
    finally:
        store.close()
    return events, state
