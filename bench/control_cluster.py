"""The set-up bench/control.py measures: a control process in the bench's process, one worker
process, one ledger; the block layouts it uses; the run's commit."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from residency.control.moves import MoveConfig  # noqa: E402
from residency.control.policy import PolicyConfig  # noqa: E402
from residency.control.proc import ControlConfig, ControlProc  # noqa: E402
from residency.events.asks import AskCommitBlocks  # noqa: E402
from residency.ledger import LedgerStore  # noqa: E402

import commit  # noqa: E402  (bench/commit.py)
import placement  # noqa: E402  (bench/placement.py)

SMALL_LAYOUT = "2,16,2,64,float16"          # 16 KiB blocks: a one-block move is latency, not bandwidth
BIG_LAYOUT = "32,16,8,128,bfloat16"         # 2 MiB blocks (Llama-8B-like pages): spills are bandwidth


def git_commit() -> str:
    return commit.git_commit(("control", "dataplane", "bench/control.py", "bench/control_cluster.py",
                              "bench/control_spill.py"))


def write_result(out: dict, stem: str, out_arg: str | None) -> Path:
    """Write a bench's JSON to ``out_arg``, or to bench/results/<stem>-<date>-<machine>.json."""
    path = Path(out_arg) if out_arg else ROOT / "bench" / "results" / f"{stem}-{out['date']}-{out['machine']}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Cluster:
    """A control process in this process, one worker process, one ledger."""

    def __init__(self, url: str, engine: str, device: str, layout: str, device_blocks: int, host_bytes: int,
                 durability: str = "normal", traced: bool = False, lane: bool = True,
                 cpus: tuple[int | None, int | None] = (None, None), nearly_done: bool = False,
                 ahead: bool = False, early: bool = False, keep_awake: bool = False,
                 ahead_min_bytes: int = 64 << 20, early_ack: bool = True):
        """``cpus``: (the control's loop thread, the worker's device thread), each with its ZMQ
        I/O thread, on that CPU (bench/placement.py); None: unplaced. ``ahead``: the control's
        CommandAhead (it carries the command of a device <-> host copy); the worker always
        begins a move on it, so ``early`` no longer changes anything."""
        if not (lane and early_ack):
            raise ValueError("the worker always has its lane and acks early: no-lane and late-ack are gone")
        self.dir = Path(tempfile.mkdtemp(prefix="rcb-", dir="/tmp"))
        self.store = LedgerStore.open(url, create=True)
        cfg = ControlConfig(worker_endpoint=f"ipc://{self.dir}/w.sock", expected_workers=[0], release_on_stop=False,
                            durability=durability, policy=PolicyConfig(pressure=False, park=False),
                            moves=MoveConfig(deadline_base_s=60.0), checkpoint_every_events=10_000,
                            trace_moves=64 if traced else 0, command_ahead_min_bytes=ahead_min_bytes if ahead else 0,
                            keep_awake=keep_awake, keep_awake_min_bytes=ahead_min_bytes)
        self.ctx = placement.context_on(cpus[0]) if cpus[0] is not None else None
        self.proc = ControlProc(self.store, cfg, ctx=self.ctx).start()
        if cpus[0] is not None:
            placement.pin_loop(self.proc, cpus[0])     # after the ledger writer's thread started: it stays unplaced
        # the worker always says MoveNearlyDone and heeds CommandAhead (``nearly_done`` no longer
        # changes it); the benches' worker (bench/worker.py) moves no bytes with --nocopy
        argv = [sys.executable, str(ROOT / "bench" / "worker.py"), "--worker", "0", "--control", cfg.worker_endpoint,
                "--run-dir", str(self.dir), "--device", device, "--kv-layout", layout,
                "--device-blocks", str(device_blocks), "--host-bytes", str(host_bytes), "--disk-bytes", "0",
                "--no-disk-fsync", "--model", "none"] + (["--cpu", str(cpus[1])] if cpus[1] is not None else []) + (
                    ["--nocopy"] if engine == "nocopy" else []) + (["--report-timings"] if traced else [])
        if device == "cpu":
            argv += ["--torch-threads", "1"]
        self.worker = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while not self.proc.call(lambda p: 0 in p.workers.by_worker).result(10):
            if time.monotonic() > deadline or self.worker.poll() is not None:
                raise RuntimeError("the worker did not join")
            time.sleep(0.05)

    def commit(self, n: int, tier: str = "device") -> list[int]:
        out: list[int] = []
        while len(out) < n:
            k = min(4096, n - len(out))
            ans = self.proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="bench", tier=tier,
                                                   num_blocks=k)).result(600)
            if ans.error:
                raise RuntimeError(f"commit failed: {ans.error}: {ans.detail}")
            out += ans.events[0].blocks
        return out

    def close(self) -> None:
        self.proc.stop("bench done")
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        self.worker.terminate()
        try:
            self.worker.wait(20)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def layout_bytes(spec: str) -> int:
    from residency.dataplane.build import layout_block_bytes, parse_layout  # noqa: PLC0415
    return layout_block_bytes(parse_layout(spec))
