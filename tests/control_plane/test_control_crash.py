"""kill -9 the control process at each point of a move's life, and at random points; restart it.

Real processes: `residency serve` kills itself at the named point (RESIDENCY_CONTROL_FAULTS); its
worker survives (its own session) and is adopted by the next `residency serve` on the same ledger,
which replays the ledger, asks the worker which moves it completed, and records the outcome of every
move that was in flight. Replay checks the invariants and every StateCheckpoint hash.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

from residency.control.transport import ControlUnreachable
from residency.events import catalog as ev
from residency.events.asks import AskCommitBlocks, AskMove, AskStatus
from residency.ledger import LedgerStore

from tests.control_plane.conftest import ServeClient, check_ledger, events_of, spawn, wait_for  # noqa: E402
from tests.control_plane.test_worker_kill import serve_argv  # noqa: E402

pytestmark = pytest.mark.slow


class Server:
    """`residency serve` on one ledger and run dir, started again and again."""

    def __init__(self, url, run_dir, log_path):
        self.url, self.run_dir, self.log_path = url, run_dir, log_path
        self.client = ServeClient(run_dir, timeout_s=10)
        self.popen = None

    def start(self, faults: str = "", crash_may_come_first: bool = False):
        """Start and wait for the worker to link. With ``crash_may_come_first`` an injected crash
        during recovery itself (before the link) is one more random point, not a failure."""
        env = {"RESIDENCY_CONTROL_FAULTS": faults, "RESIDENCY_LOG_FORMAT": "console"}
        self.popen = spawn(serve_argv(self.url, self.run_dir, adopt_grace_s=8), self.log_path, env=env)
        self.crash_may_come_first = crash_may_come_first
        wait_for(self.worker_linked, timeout=60, interval=0.1, what="worker linked")
        return self

    def worker_linked(self) -> bool:
        if self.popen.poll() is not None:
            if self.crash_may_come_first and self.popen.returncode == -signal.SIGKILL:
                return True
            raise AssertionError(f"serve exited with {self.popen.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            return self.client.ask(AskStatus(ask_id="t", include_state=False), timeout_s=2).metrics.get(
                "workers_linked", 0) >= 1
        except ControlUnreachable:
            return False

    def ask(self, msg, timeout_s=10):
        return self.client.ask(msg, timeout_s=timeout_s)

    def wait_crashed(self):
        rc = self.popen.wait(20)
        assert rc == -signal.SIGKILL, f"serve exited with {rc}, not by its own SIGKILL"


def _last_requested(url):
    with LedgerStore.open(url) as store:
        return [r.event for r in events_of(store, ev.MoveRequested)][-1]


def _outcome(url, mid):
    with LedgerStore.open(url) as store:
        return [type(r.event).__name__ for r in store.read()
                if getattr(r.event, "move_id", None) == mid
                and type(r.event) not in (ev.MoveRequested, ev.MoveDispatched)]     # an outcome: neither


def test_control_killed_at_each_point_of_a_move_and_at_random_points_then_restarted(tmp_path, short_dir, rng):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    srv = Server(url, short_dir, tmp_path / "serve.log")
    worker_pid = None
    try:
        # 1. killed after MoveRequested is committed, before the command is sent
        srv.start("crash_after_requested=1")
        worker_pid = int((short_dir / "worker-0.pid").read_text().split()[0])
        ans = srv.ask(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=32))
        blocks = ans.events[0].blocks
        with pytest.raises(ControlUnreachable):
            srv.ask(AskMove(ask_id="m1", kind="evict", worker=0, blocks=blocks[0:2]), timeout_s=3)
        srv.wait_crashed()
        m1 = _last_requested(url).move_id

        # 2. restarted: m1 never reached the worker -> abandoned. Then killed after sending m2.
        srv.start("crash_after_dispatch=1")
        wait_for(lambda: _outcome(url, m1), what="m1 settled")
        assert _outcome(url, m1) == ["MoveAbandoned"]
        with pytest.raises(ControlUnreachable):
            srv.ask(AskMove(ask_id="m2", kind="evict", worker=0, blocks=blocks[2:4]), timeout_s=3)
        srv.wait_crashed()
        m2 = _last_requested(url).move_id

        # 3. restarted: the worker did m2 -> acked from its report. Then killed between m3's ack and its append.
        srv.start("crash_before_ack_append=1")
        wait_for(lambda: _outcome(url, m2), what="m2 settled")
        assert _outcome(url, m2) == ["MoveAcked"]
        with pytest.raises(ControlUnreachable):
            srv.ask(AskMove(ask_id="m3", kind="spill", worker=0, blocks=blocks[4:6]), timeout_s=3)
        srv.wait_crashed()
        m3 = _last_requested(url).move_id

        # 4. restarted with no fault: m3's ack, lost with the process, is recorded from the report
        srv.start()
        wait_for(lambda: _outcome(url, m3), what="m3 settled")
        assert _outcome(url, m3) == ["MoveAcked"]
        srv.popen.send_signal(signal.SIGKILL)
        srv.popen.wait(10)

        # 5. killed at random points of a stream of moves, restarted each time
        for round_ in range(4):
            n = rng.randint(2, 40)
            srv.start(f"crash_after_events={n}", crash_may_come_first=True)
            for i in range(200):
                if srv.popen.poll() is not None:
                    break
                b = rng.choice(blocks)
                kind = rng.choice(["evict", "restore", "spill", "demote", "promote"])
                try:
                    srv.ask(AskMove(ask_id=f"r{round_}-{i}", kind=kind, worker=0, blocks=[b]), timeout_s=2)
                except ControlUnreachable:
                    break
            if srv.popen.poll() is None:
                # the asks of this round were mostly refused as invalid (refusals of an ask record
                # nothing) and never reached the crash point: kill -9 it here, one more random point
                try:
                    srv.popen.wait(5)
                except subprocess.TimeoutExpired:
                    srv.popen.send_signal(signal.SIGKILL)
            srv.popen.wait(20)

        # the last restart: everything in flight is settled; one more move; a clean stop
        srv.start()
        with LedgerStore.open(url) as store:
            wait_for(lambda: not check_ledger(store, allow_inflight=True).inflight, timeout=20,
                     what="every move in flight settled")
        srv.popen.send_signal(signal.SIGTERM)
        assert srv.popen.wait(30) == 0
    finally:
        if srv.popen is not None and srv.popen.poll() is None:
            srv.popen.kill()
        if worker_pid is not None:
            try:
                os.kill(worker_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    with LedgerStore.open(url) as store:
        state = check_ledger(store)
        types = [type(r.event).__name__ for r in store.read()]
    assert types.count("ServerStarted") >= 5 and types[-1] == "ServerStopped"   # random kills may come first
    assert types.count("WorkerJoined") == 1          # the same worker, adopted by every incarnation
    assert state.workers[0].alive and not state.inflight
    log = (tmp_path / "serve.log").read_text()
    # 3 fixed restarts and the last one adopt for sure; a random round may crash before adopting
    assert 4 <= log.count("worker_adopted") <= 8
