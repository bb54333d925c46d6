"""`residency serve`, `residency ctl`, `residency status` as a user runs them; SIGTERM stops everything
and the ledger records it (every copy freed by the book, then ServerStopped)."""
from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import sys

import pytest

from residency.control.transport import ControlUnreachable
from residency.events.asks import AskStatus
from residency.ledger import LedgerStore

from tests.control_plane.conftest import REPO, RESIDENCY, SMALL_BLOCK, ServeClient, check_ledger, spawn, wait_for  # noqa: E402
from tests.control_plane.test_worker_kill import serve_argv  # noqa: E402

pytestmark = pytest.mark.slow


def cli(*args, run_dir, url) -> subprocess.CompletedProcess:
    """`residency ARGS` in this process (the same ``main`` the console script runs)."""
    from residency.control.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*args, "--ledger", url, "--run-dir", str(run_dir), "--timeout", "20"])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def test_serve_ctl_status_and_a_clean_stop_on_sigterm(tmp_path, short_dir):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    serve = spawn(serve_argv(url, short_dir), tmp_path / "serve.log",
                  env={"RESIDENCY_LOG_FORMAT": "console"})
    client = ServeClient(short_dir, timeout_s=5)

    def linked():
        try:
            return client.ask(AskStatus(ask_id="t", include_state=False), timeout_s=1).metrics["workers_linked"] >= 1
        except ControlUnreachable:
            return False

    try:
        wait_for(linked, timeout=30, interval=0.1, what="worker linked")
        r = cli("ctl", "commit", "--blocks", "8", "--session", "chat-1", run_dir=short_dir, url=url)
        assert r.returncode == 0 and "committed 8 blocks (0..7) on device of worker 0, session chat-1" in r.stdout, r
        r = cli("ctl", "park", "--session", "chat-1", run_dir=short_dir, url=url)
        assert r.returncode == 0, r
        assert "acked" in r.stdout and "moved 128.0 KiB, freed 128.0 KiB at the source" in r.stdout
        assert "session chat-1 parked on host: 128.0 KiB" in r.stdout
        r = cli("ctl", "park", "--session", "chat-1", run_dir=short_dir, url=url)      # again: nothing to do
        assert r.returncode == 0 and r.stdout.strip() == (
            "session 'chat-1' has no blocks on device (8 blocks: 8 on host); nothing moved"), r
        r = cli("ctl", "budget", "--tier", "device", "--floor", "16MiB", run_dir=short_dir, url=url)
        assert r.returncode == 0 and "floor 16.0 MiB" in r.stdout, r
        r = cli("ctl", "restore", "--session", "chat-1", run_dir=short_dir, url=url)
        assert r.returncode == 1, r                      # refused, with its arithmetic
        assert "refused (operator:restore): asked 128.0 KiB on device of worker 0, available 0 B" in r.stdout
        assert "floor 16777216" in r.stdout
        r = cli("ctl", "budget", "--tier", "device", "--floor", "0", run_dir=short_dir, url=url)
        r = cli("ctl", "restore", "--session", "chat-1", "--json", run_dir=short_dir, url=url)
        assert r.returncode == 0, r
        events = json.loads(r.stdout)["events"]
        assert [e["type"] for e in events] == ["MoveAcked", "SessionRestored"]
        assert events[0]["bytes_moved"] == 8 * SMALL_BLOCK
        r = cli("ctl", "evict", "--blocks", "99", run_dir=short_dir, url=url)
        assert r.returncode == 2 and "invalid_ask: worker 0 has no blocks [99]" in r.stderr, r
        r = cli("status", run_dir=short_dir, url=url)
        assert r.returncode == 0 and "health: ok" in r.stdout, r
        assert "alive   device  16.0 MiB  128.0 KiB" in r.stdout, r.stdout
        r = cli("status", "--json", run_dir=short_dir, url=url)
        st = json.loads(r.stdout)
        assert st["healthy"] and st["in_flight"] == [] and st["stranded"] == []
    finally:
        serve.send_signal(signal.SIGTERM)
        rc = serve.wait(30)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-2000:]
    r = cli("status", run_dir=short_dir, url=url)
    assert r.returncode == 2 and "no server is running" in r.stderr
    with LedgerStore.open(url) as store:
        state = check_ledger(store)
        # the stop's pinned releases (one per grant) come right before ServerStopped
        last = [type(r.event).__name__ for r in store.read() if type(r.event).__name__ != "PinnedReleased"][-3:]
    assert last[-1] == "ServerStopped" and not state.server_up
    assert not state.blocks.get(0) and state.tier(0, "device").used_bytes == 0    # freed by the book
    assert "CopiesReleased" in last


def test_after_a_clean_stop_replay_shows_the_worker_stopped_and_the_next_start_warns_of_nothing(tmp_path, short_dir):
    from residency.control.replay import replay
    from residency.control.views import render_text, summarize

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    client = ServeClient(short_dir, timeout_s=5)

    def linked():
        try:
            return client.ask(AskStatus(ask_id="t", include_state=False), timeout_s=1).metrics["workers_linked"] >= 1
        except ControlUnreachable:
            return False

    for turn in (1, 2):
        log_path = tmp_path / f"serve-{turn}.log"
        serve = spawn(serve_argv(url, short_dir), log_path, env={"RESIDENCY_LOG_FORMAT": "json"})
        try:
            wait_for(linked, timeout=30, interval=0.1, what="worker linked")
            if turn == 1:     # disk copies outlive the stop (--keep-disk): the next start settles them
                r = cli("ctl", "commit", "--blocks", "4", "--session", "s", run_dir=short_dir, url=url)
                assert r.returncode == 0, r
                r = cli("ctl", "park", "--session", "s", "--to", "disk", run_dir=short_dir, url=url)
                assert r.returncode == 0, r
        finally:
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(30) == 0, log_path.read_text()[-2000:]
        with LedgerStore.open(url) as store:
            summary = summarize(replay(store)[0])
        [w] = summary["workers"]
        assert w["status"] == "stopped" and not w["alive"], w
        assert "stopped with the server" in render_text(summary)
    lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
    warned = [x for x in lines if x.get("level") in ("warning", "error")]
    assert not warned, warned
    assert any(x.get("event") == "worker_lost" and "stopped with the server" in x.get("reason", "") for x in lines)
