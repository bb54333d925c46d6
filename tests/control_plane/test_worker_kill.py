"""kill -9 a worker in the middle of a large spill, and in the middle of a restore (real processes:
`residency serve`, its worker, the real mover). The ledger names what the dead worker took with it,
the supervisor starts a new one, and replay checks the invariants."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from residency.events import catalog as ev
from residency.events.asks import AskCommitBlocks, AskMove, AskStatus
from residency.ledger import LedgerStore

from tests.control_plane.conftest import (  # noqa: E402
    REPO, RESIDENCY, SMALL_BLOCK, SMALL_LAYOUT, ServeClient, check_ledger, events_of, kill_pid_file, spawn, wait_for,
)

pytestmark = pytest.mark.slow


def serve_argv(url: str, run_dir, **extra) -> list[str]:
    argv = [*RESIDENCY, "serve", "--ledger", url, "--run-dir", str(run_dir),
            "--kv-layout", SMALL_LAYOUT, "--device-blocks", "1024", "--host-bytes", str(2048 * SMALL_BLOCK),
            "--disk-bytes", str(2048 * SMALL_BLOCK), "--no-disk-fsync", "--no-policies", "--port", "0",
            "--heartbeat-lost-s", "3", "--orphan-exit-s", "20", "--move-deadline-s", "30", "--model", "none"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def status(client):
    return client.ask(AskStatus(ask_id="t"), timeout_s=10)


def worker_up(client, n: int = 1) -> bool:
    try:
        return status(client).metrics.get("workers_linked", 0) >= n
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_kill_9_a_worker_in_the_middle_of_a_large_spill_and_of_a_restore(tmp_path, short_dir):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    run_dir = short_dir
    serve = spawn(serve_argv(url, run_dir), tmp_path / "serve.log",
                  env={"RESIDENCY_WORKER_FAULTS": "exec_delay_ms=1500", "RESIDENCY_LOG_FORMAT": "console"})
    client = ServeClient(run_dir, timeout_s=30)
    try:
        wait_for(lambda: worker_up(client), timeout=60, interval=0.2, what="worker joined")
        ans = client.ask(AskCommitBlocks(ask_id="c", worker=0, session="big", tier="device", num_blocks=512))
        assert ans.error is None, ans
        blocks = ans.events[0].blocks
        # a large spill (8 MiB in 512 blocks): wait=False answers once its MoveRequested is committed
        ans = client.ask(AskMove(ask_id="s", kind="spill", worker=0, blocks=blocks, wait=False))
        spill_id = ans.move_ids[0]
        time.sleep(0.6)                                  # the worker is half-way through it
        kill_pid_file(run_dir, 0, signal.SIGKILL)
        with LedgerStore.open(url) as store:
            wait_for(lambda: events_of(store, ev.WorkerLost), timeout=15, what="WorkerLost")
        # the supervisor starts a new worker; a restore on it, killed half-way too
        wait_for(lambda: worker_up(client), timeout=60, interval=0.2, what="new worker joined")
        ans = client.ask(AskCommitBlocks(ask_id="c2", worker=0, session="back", tier="host", num_blocks=256))
        assert ans.error is None, ans
        host_blocks = ans.events[0].blocks
        ans = client.ask(AskMove(ask_id="r", kind="restore", worker=0, session="back", wait=False))
        restore_id = ans.move_ids[0]
        time.sleep(0.6)
        kill_pid_file(run_dir, 0, signal.SIGKILL)
        with LedgerStore.open(url) as store:
            wait_for(lambda: len(events_of(store, ev.WorkerLost)) == 2, timeout=15, what="second WorkerLost")
    finally:
        serve.send_signal(signal.SIGTERM)
        rc = serve.wait(60)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    with LedgerStore.open(url) as store:
        state = check_ledger(store)
        lost = [r.event for r in events_of(store, ev.WorkerLost)]
        stranded = {r.event.move_id: r.event for r in events_of(store, ev.MoveStranded)}
        types = [type(r.event).__name__ for r in store.read()]
    # the spill: in flight when its worker died -> stranded with its planned bytes, named as worker_lost
    assert stranded[spill_id].why == "worker_lost" and stranded[spill_id].bytes_at_risk == 512 * SMALL_BLOCK
    assert lost[0].blocks_lost == blocks and lost[0].bytes_lost == 512 * SMALL_BLOCK
    assert "exited" in lost[0].reason
    # the restore, likewise; the blocks lost are those of the second incarnation
    assert stranded[restore_id].why == "worker_lost" and stranded[restore_id].bytes_at_risk == 256 * SMALL_BLOCK
    assert lost[1].blocks_lost == host_blocks
    # each byte once: the moves' blocks are among those their lost workers took with them
    assert state.stranded_bytes_total() == 512 * SMALL_BLOCK + 256 * SMALL_BLOCK
    with LedgerStore.open(url) as store, store.engine.connect() as conn:
        viewed = conn.exec_driver_sql("SELECT SUM(bytes) FROM residency_stranded").scalar_one()
    assert viewed == state.stranded_bytes_total()
    assert types.count("WorkerJoined") >= 2 and types[-1] == "ServerStopped"
