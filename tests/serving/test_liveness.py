"""Liveness that means progress, against a real ``residency serve`` with the real SmolLM2:

  a worker whose engine freezes (the ``stall_step`` fault: its I/O thread still answers pings) is
  declared wedged: its request is answered 503 with Retry-After, new ones are refused the same
  way, /health says 503 naming it, the ledger records WorkerWedged then WorkerResumed, and
  ``residency diagnose`` shows the episode from its onset row;
  a worker killed with a request in flight answers that request 503 with Retry-After, not 500.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model

STALL_MS = 20_000            # long enough for any deadline the measured steps may set on a loaded host


def _chat(server: Server, max_tokens: int, timeout: float = 120) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a ship."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def _retryable(r: httpx.Response, code: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "server_error"


def test_a_worker_whose_engine_freezes_is_wedged_answered_refused_healthy_again_and_diagnosed(tmp_path, monkeypatch):
    monkeypatch.setenv("RESIDENCY_WORKER_FAULTS", f"stall_step=4:{STALL_MS}")
    s = Server(tmp_path, "--no-policies", "--wedged-after-s", "1").wait_ready()
    try:
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        _retryable(_chat(s, 64, timeout=STALL_MS / 1000), "worker_wedged")     # frozen at its 4th step
        assert time.monotonic() - t0 < STALL_MS / 1000, "answered only once the engine woke up"
        h = httpx.get(f"{s.url}/health", timeout=10)
        assert h.status_code == 503 and h.json()["wedged_workers"] == [0], h.text
        assert any(p.startswith("worker 0 is wedged") for p in h.json()["problems"])
        _retryable(_chat(s, 4), "worker_wedged")          # tokenized on the side threads, refused at admission
        deadline = time.monotonic() + STALL_MS / 1000 + 60
        while httpx.get(f"{s.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, s.tail()
            time.sleep(0.2)
        again = _chat(s, 4)
        # the fault fires once; a host loaded enough to stretch a later step past the 1 s wedge
        # deadline wedges the worker again, for real: wait that one out too (each is in the ledger)
        while (again.status_code == 503 and again.json()["error"]["code"] == "worker_wedged"
               and time.monotonic() < deadline):
            time.sleep(0.5)
            again = _chat(s, 4)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4, again.text
    finally:
        assert s.stop() == 0
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    wedged = next(r for r in events if type(r.event) is ev.WorkerWedged)     # the fault's (the first)
    w = wedged.event
    assert w.worker == 0 and w.running == 1 and len(w.request_ids) == 1 and w.last_step == 3
    assert w.stalled_ms > w.deadline_ms >= 1000
    later = [r.event for r in events if r.seq > wedged.seq]
    [finished] = [e for e in later if type(e) is ev.RequestFinished and e.request_id == w.request_ids[0]]
    assert finished.reason == "error" and finished.completion_tokens == 3     # sampled by steps 1 to 3
    assert any(type(e) is ev.RequestRefused and e.reason.startswith("worker_wedged: worker 0") for e in later)
    resumed = next(e for e in later if type(e) is ev.WorkerResumed)
    assert resumed.worker == 0 and resumed.step >= 4
    # the cancelled sequence's pages, freed when the engine woke, are in the books
    assert any(type(e) is ev.BlocksFreed and e.reason == "orphaned" for e in later)

    out = subprocess.run([sys.executable, "-m", "residency.control.cli.main", "diagnose", "--db", s.ledger, "--json"],
                         capture_output=True, text=True, timeout=120)
    found = [f for f in json.loads(out.stdout)["findings"] if f["detector"] == "wedged_worker"]
    assert len(found) == 1, out.stdout + out.stderr
    f = found[0]
    assert f["subject"] == "worker 0" and f["detail"]["onset_seq"] == wedged.seq and wedged.seq in f["seqs"]
    assert f["detail"]["ended"] == "resumed" and f["detail"]["requests_refused"] == 1


def test_a_worker_killed_with_a_request_in_flight_answers_it_503_with_retry_after(tmp_path):
    s = Server(tmp_path, "--no-policies").wait_ready()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=_chat(s, 1500)))
    try:
        t.start()
        deadline = time.monotonic() + 60
        while "residency_requests_running 1.0" not in httpx.get(f"{s.url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.05)
        pid = int((s.dir / "run" / "worker-0.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        _retryable(out["r"], "worker_lost")
    finally:
        t.join(60)
        assert s.stop() == 0
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    assert any(type(r.event) is ev.WorkerLost for r in events)
    assert [r.event.reason for r in events if type(r.event) is ev.RequestFinished] == ["error"]


def test_a_worker_killed_while_its_pipelined_restore_lands_answers_that_turn_503_and_serves_the_next(
        tmp_path, monkeypatch):
    """The returning turn runs while its restore lands; the worker dies after the prefill that read
    the landing pages and before the restore's ack (``crash_after_moves``: the park is move 1, the
    restore move 2). That turn is answered as any on a lost worker, the books add up on replay,
    and the session's next turn is served by the new incarnation (recomputed: the host copy died
    with the process)."""
    monkeypatch.setenv("RESIDENCY_WORKER_FAULTS", "crash_after_moves=2")
    s = Server(tmp_path, "--no-policies", "--restore-policy", "restore").wait_ready()

    def turn(convo):
        body = {"model": MODEL, "messages": convo, "max_tokens": 6, "temperature": 0, "session_id": "s"}
        return httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)

    try:
        convo = [{"role": "user", "content": "Hi! What is the capital of France?"}]
        r = turn(convo)
        assert r.status_code == 200, r.text
        convo += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And of Italy?"}]
        assert s.admin("POST", "/admin/sessions/s/park").status_code == 200
        _retryable(turn(convo), "worker_lost")
        deadline = time.monotonic() + 180
        while (again := turn(convo)).status_code == 503:          # until the new incarnation serves
            assert time.monotonic() < deadline, s.tail()
            time.sleep(0.5)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["restored_tokens"] == 0
    finally:
        assert s.stop() == 0
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    restore = [r.event for r in events if type(r.event) is ev.MoveRequested and r.event.kind == "restore"]
    assert len(restore) == 1 and any(type(r.event) is ev.WorkerLost for r in events)
    ends = [type(r.event).__name__ for r in events if getattr(r.event, "move_id", None) == restore[0].move_id]
    assert "MoveAcked" not in ends and any(e in ends for e in ("MoveAbandoned", "MoveStranded")), ends
    assert "error" in [r.event.reason for r in events if type(r.event) is ev.RequestFinished]
