"""Fixtures of the control-plane suite: ledgers, a control process, a scripted worker, the invariants.

``check_ledger(store)`` is the end of every fault test: replay the whole ledger and check
  * bytes conserved per tier (``check_integrity``: used == copies x block_bytes <= capacity),
  * exactly one terminal event per MoveRequested (a MoveLateAcked only after a MoveStranded),
  * stranded bytes listed with their moves (per tier: the sum over the listed moves),
  * every StateCheckpoint's hash == the replayed state's hash at its seq (live == replay).

``FakeWorker`` is a real DEALER socket the test drives by hand, so protocol faults (a duplicate,
a late, a missing ack) happen exactly when the test says.
"""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import threading
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from residency.control.fold import fold
from residency.control.state import LOST, State, check_integrity, state_hash
from residency.events import catalog as ev
from residency.events.codec import encode_message
from residency.events.commands import Hello, Ping, Pong, ToWorker

REPO = Path(__file__).resolve().parents[2]
TERMINAL = set(ev.TERMINAL_MOVE_EVENTS)
SMALL_LAYOUT = "2,16,2,64,float16"          # 16 KiB blocks
SMALL_BLOCK = 16384
# the `residency` console script, as installed (``python -m residency.control.cli.main`` would import that module twice)
RESIDENCY = [sys.executable, "-c", "import sys; from residency.control.cli.main import main; sys.exit(main(sys.argv[1:]))"]


# ---------------------------------------------------------------------- ledgers
@pytest.fixture
def short_dir():
    """A short directory for ipc sockets (unix socket paths must stay under ~100 bytes)."""
    d = tempfile.mkdtemp(prefix="rcp-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_url(request, tmp_path) -> str:
    """SQLite in a file; and PostgreSQL when RESIDENCY_TEST_PG_URL is set (fails if unreachable)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


LATE = {"MoveLateAcked", "MoveLateFailed"}    # a stranding's late answers (at most one)


def check_ledger(store, *, allow_inflight: bool = False) -> State:
    """Replay everything; check the invariants named in the module docstring; return the state."""
    state = State()
    terminals: dict[str, list[str]] = collections.defaultdict(list)
    requested: set[str] = set()
    stranded_at: dict[str, int] = {}
    for rec in store.read():
        e = rec.event
        t = type(e).__name__
        if t == "MoveRequested":
            requested.add(e.move_id)
        elif t == "CopiesReleased":                      # a release's answer: its ack, or its late ack
            terminals[e.move_id].append("MoveLateAcked" if e.move_id in stranded_at else "MoveAcked")
        elif t in TERMINAL or t in LATE:
            terminals[e.move_id].append(t)
            if t == "MoveStranded":
                stranded_at[e.move_id] = e.bytes_at_risk
        fold(state, rec)
    check_integrity(state)
    for mid in requested:
        outs = terminals.get(mid, [])
        first = [o for o in outs if o not in LATE]
        late = [o for o in outs if o in LATE]
        if not outs:
            assert allow_inflight and mid in state.inflight, f"move {mid} has no terminal outcome"
            continue
        assert len(first) == 1, f"move {mid} has {len(first)} terminal outcomes: {outs}"
        assert len(late) <= 1, f"move {mid} answered late {len(late)} times: {outs}"
        if late:
            assert first[0] == "MoveStranded" and outs.index(late[0]) > outs.index("MoveStranded"), outs
    assert not set(terminals) - requested, f"outcomes for moves never requested: {sorted(set(terminals) - requested)[:5]}"
    # stranded bytes are listed with their moves
    listed = {mid: mv.bytes_planned for mid, mv in state.stranded.items()}
    unresolved = {mid: b for mid, b in stranded_at.items() if not LATE.intersection(terminals[mid])}
    assert listed == unresolved
    per_tier = collections.Counter()
    for mv in state.stranded.values():
        if mv.status != LOST:                            # a lost worker's bytes are in its bytes_lost
            per_tier[(mv.worker, mv.src)] += mv.bytes_planned
    for w, ws in state.workers.items():
        for t, acc in ws.tiers.items():
            assert acc.stranded_bytes == per_tier[(w, t)], (w, t, acc.stranded_bytes, per_tier[(w, t)])
    check_checkpoints(store)
    return state


def check_checkpoints(store) -> int:
    """Every StateCheckpoint hash equals the hash of the state replayed through its seq."""
    wanted: dict[int, list[str]] = collections.defaultdict(list)
    for rec in store.read():
        if type(rec.event) is ev.StateCheckpoint:
            wanted[rec.event.through_seq].append(rec.event.state_hash)
    if not wanted:
        return 0
    state = State()
    n = 0
    for rec in store.read(1, max(wanted)):
        fold(state, rec)
        for h in wanted.get(rec.seq, ()):
            assert state_hash(state) == h, f"StateCheckpoint through seq {rec.seq}: live hash != replayed hash"
            n += 1
    return n


def events_of(store, *types) -> list:
    names = {t.__name__ for t in types}
    return [r for r in store.read() if type(r.event).__name__ in names]


def wait_for(pred, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# ---------------------------------------------------------------------- a control process in this process
@pytest.fixture
def make_control(short_dir):
    """make_control(url, **ControlConfig overrides) -> (proc, store). Stopped at teardown."""
    from residency.control.moves import MoveConfig
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
    from residency.ledger import LedgerStore

    made = []

    def make(url: str, **over):
        store = LedgerStore.open(url, create=True)
        moves = over.pop("moves", MoveConfig(deadline_base_s=over.pop("deadline_s", 5.0)))
        endpoint = over.pop("worker_endpoint", f"ipc://{short_dir}/w.sock")
        cfg = ControlConfig(worker_endpoint=endpoint, ask_endpoint=f"ipc://{short_dir}/c.sock",
                            policy=over.pop("policy", PolicyConfig(pressure=False, park=False)),
                            moves=moves, **{"release_on_stop": False, "shutdown_grace_s": 0.5,
                                            "deadline_grace_s": 0.05, **over})
        proc = ControlProc(store, cfg).start()
        made.append((proc, store))
        return proc, store

    yield make
    for proc, store in made:
        proc.stop("test teardown")
        store.close()


# ---------------------------------------------------------------------- a scripted worker
class FakeWorker:
    """A DEALER the test drives: it answers Pings by itself and hands every other command over."""

    _decoder = msgspec.msgpack.Decoder(ToWorker)

    def __init__(self, endpoint: str, worker: int = 0, epoch: int = 1, block_bytes: int = 4096,
                 tiers: dict[str, int] | None = None, identity: bytes | None = None, key: bytes | None = None):
        from residency.events import handshake

        self.worker, self.epoch, self.block_bytes = worker, epoch, block_bytes
        self.tiers = tiers or {"device": 64 * block_bytes, "host": 128 * block_bytes, "disk": 256 * block_bytes}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity if identity is not None else b"w%d" % worker)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a DEALER with no connected peer blocks in send; a peer the control refused at the handshake
        # has none, so a send gives up (zmq.Again) rather than hang the test run
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)
        if key is not None:      # a peer key proven in the handshake (a keyed control takes no other)
            handshake.apply(self.sock, handshake.client_options(key, endpoint, "worker"))
        self.sock.connect(endpoint)
        self.answer_pings = True

    def hello(self, epoch: int | None = None, disk_blocks: list[int] | None = None) -> None:
        self.send(Hello(worker=self.worker, epoch=self.epoch if epoch is None else epoch, device="cpu",
                        tiers=self.tiers, block_bytes=self.block_bytes, disk_blocks=disk_blocks or []))

    def send(self, msg) -> None:
        self.sock.send(encode_message(msg))

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 5.0, raw: bool = False):
        """The next message that is not a Ping (Pings are answered, unless answer_pings is False)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"worker {self.worker}: nothing received within {timeout} s")
            data = self.sock.recv()
            try:
                msg = self._decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                from residency.events.codec import decode_message
                msg = decode_message(data)
            if type(msg) is Ping:
                if self.answer_pings:
                    self.send(Pong(worker=self.worker, nonce=msg.nonce, ts_ns=time.time_ns()))
                continue
            return msg

    def expect(self, msg_type, timeout: float = 5.0):
        msg = self.recv(timeout)
        assert type(msg) is msg_type, f"expected {msg_type.__name__}, got {msg!r}"
        return msg

    def quiet(self, seconds: float) -> list:
        """Everything but Pings that arrives within ``seconds``."""
        out = []
        deadline = time.monotonic() + seconds
        while True:
            try:
                out.append(self.recv(max(0.001, deadline - time.monotonic())))
            except AssertionError:
                return out

    def ack(self, cmd, **over) -> ev.MoveAcked:
        n = len(cmd.blocks) * self.block_bytes
        fields = dict(move_id=cmd.move_id, worker=self.worker, bytes_moved=n,
                      bytes_freed_src=0 if cmd.keep_source else n, checksum_ok=True,
                      started_ns=time.time_ns(), finished_ns=time.time_ns())
        fields.update(over)
        return ev.MoveAcked(**fields)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def fake_worker(short_dir):
    made = []

    def make(**kw) -> FakeWorker:
        w = FakeWorker(f"ipc://{short_dir}/w.sock", **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def joined(proc, worker: int = 0) -> bool:
    return proc.call(lambda p: worker in p.workers.by_worker).result(5)


def commit_blocks(proc, fw: FakeWorker, n: int, session: str | None = "s", tier: str = "device") -> list[int]:
    """Commit n blocks through the control process, the fake worker answering the CommitBlocks."""
    from residency.events.commands import BlocksWritten, CommitBlocks
    from residency.events.asks import AskCommitBlocks

    fut = proc.submit(AskCommitBlocks(ask_id="commit", worker=fw.worker, session=session, tier=tier, num_blocks=n))
    cmd = fw.expect(CommitBlocks)
    fw.send(BlocksWritten(request_id=cmd.request_id, worker=fw.worker, tier=tier, blocks=cmd.blocks,
                          bytes=len(cmd.blocks) * fw.block_bytes, keys=[""] * len(cmd.blocks)))
    ans = fut.result(5)
    assert ans.error is None, ans
    return list(cmd.blocks)


# ---------------------------------------------------------------------- real processes
class ServeClient:
    """An ask client of a `residency serve` in ``run_dir``: it reads the run's peer key at each
    ask, since serve writes it only once it starts (before that: ``ControlUnreachable``)."""

    def __init__(self, run_dir: Path, timeout_s: float = 10.0):
        self.run_dir, self.timeout_s = Path(run_dir), timeout_s

    def ask(self, msg, timeout_s: float | None = None):
        from residency.control.transport import AskClient, ControlUnreachable, ask_endpoint
        from residency.events.handshake import key_in

        key = key_in(self.run_dir)
        if key is None:
            raise ControlUnreachable(f"no peer key in {self.run_dir} yet (serve not started)")
        return AskClient(ask_endpoint(self.run_dir), timeout_s=self.timeout_s, key=key).ask(msg, timeout_s)


def worker_argv(worker: int, endpoint: str, run_dir: Path, *, mover: str = "real", faults: str = "",
                epoch: int = 0, device_blocks: int = 256, host_blocks: int = 512, disk_blocks: int = 1024,
                layout: str = SMALL_LAYOUT, block_bytes: int = SMALL_BLOCK) -> list[str]:
    # mover="nocopy": the benches' worker with a mover that moves no bytes (no torch)
    prog = [str(REPO / "bench" / "worker.py"), "--nocopy"] if mover == "nocopy" else ["-m", "residency.dataplane.proc"]
    argv = [sys.executable, *prog, "--worker", str(worker), "--control", endpoint,
            "--run-dir", str(run_dir), "--kv-layout", layout,
            "--device-blocks", str(device_blocks), "--host-bytes", str(host_blocks * block_bytes),
            "--disk-bytes", str(disk_blocks * block_bytes), "--no-disk-fsync", "--torch-threads", "1",
            "--orphan-exit-s", "20"]
    if faults:
        argv += ["--faults", faults]
    if epoch:
        argv += ["--epoch", str(epoch)]
    return argv


def spawn(argv: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    out = open(log_path, "ab")
    return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})


def kill_pid_file(run_dir: Path, worker: int, sig: int = 9) -> int:
    pid = int((run_dir / f"worker-{worker}.pid").read_text().split()[0])
    os.kill(pid, sig)
    return pid


def setup_control(make_control, fake_worker, url, **over):
    """A control process on ``url`` with one scripted worker joined: (proc, store, worker)."""
    proc, store = make_control(url, **over)
    fw = fake_worker()
    fw.hello()
    wait_for(lambda: joined(proc), what="worker joined")
    return proc, store, fw


class SlowDisk:
    """The ledger store, except that appends wait while ``gate`` is closed (a stalled disk)."""

    def __init__(self, store, gate: threading.Event):
        self._store, self.gate = store, gate

    def append(self, items, **kw):
        self.gate.wait()
        return self._store.append(items, **kw)

    def __getattr__(self, name):
        return getattr(self._store, name)


def gated_control(url: str, short_dir: Path, **over):
    """A control process (no policies) whose ledger appends wait while the returned gate is
    closed (open to begin with): (proc, store, gate). The caller stops the proc, closes the store."""
    from residency.control.policy import PolicyConfig
    from residency.control.proc import ControlConfig, ControlProc
    from residency.ledger import LedgerStore

    store = LedgerStore.open(url, create=True)
    gate = threading.Event()
    gate.set()
    cfg = ControlConfig(worker_endpoint=f"ipc://{short_dir}/w.sock", policy=PolicyConfig(pressure=False, park=False),
                        release_on_stop=False, **over)
    return ControlProc(SlowDisk(store, gate), cfg).start(), store, gate


@contextlib.contextmanager
def gated_cluster(url: str, short_dir: Path, log_path: Path, worker_args=(), **over):
    """``gated_control`` and one real worker process (256 device blocks of ``SMALL_LAYOUT``),
    joined: yields (proc, store, gate, worker); everything is stopped and closed after."""
    proc, store, gate = gated_control(url, short_dir, **over)
    w = spawn(worker_argv(0, proc.cfg.worker_endpoint, short_dir, device_blocks=256) + list(worker_args), log_path)
    try:
        wait_for(lambda: joined(proc), timeout=60, what="worker joined")
        yield proc, store, gate, w
    finally:
        gate.set()
        proc.stop()
        w.kill()
        store.close()


class FailingDisk(SlowDisk):
    """Appends fail once ``broken`` is set (the database went away)."""

    def __init__(self, store):
        super().__init__(store, threading.Event())
        self.gate.set()
        self.broken = False

    def append(self, items, **kw):
        if self.broken:
            from residency.ledger.errors import LedgerUnavailable
            raise LedgerUnavailable("cannot reach the ledger database (test)")
        return self._store.append(items, **kw)


def event_types(store) -> list[str]:
    """The ledger's event type names, in seq order."""
    return [type(r.event).__name__ for r in store.read()]
