"""``residency diagnose`` against a real ``residency serve`` driven into a wedge, and on healthy
traffic: the finding, its cause and its onset seq come from the ledger alone."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model


def diagnose(server: Server) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "residency.control.cli.main", "diagnose", "--db", server.ledger,
                          "--at", "now", "--json"], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)["findings"]


def chat(server: Server, text: str, max_tokens: int, session: str | None = None, timeout: float = 120) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    if session:
        body["session_id"] = session
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def diagnosed(server: Server, detectors: set[str], after_s: float, timeout_s: float = 60) -> list[dict]:
    """The findings once every one of ``detectors`` is among them. The first look comes ``after_s``
    (the longest threshold: no finding can show before it, and each look is a CLI process), then one
    a second until the deadline."""
    time.sleep(after_s)
    deadline = time.monotonic() + timeout_s
    while True:
        findings = diagnose(server)
        if detectors <= {f["detector"] for f in findings} or time.monotonic() > deadline:
            return findings
        time.sleep(1)


def waiting(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("residency_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no residency_requests_waiting metric")


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request) -> str | None:
    """None: the server's own SQLite file; else a fresh PostgreSQL schema (skipped without one)."""
    return request.getfixturevalue("pg_schema_url") if request.param == "postgresql" else None


def test_a_request_waiting_on_a_park_the_host_budget_refuses_is_named_with_the_arithmetic(tmp_path, ledger):
    # a session fills most of a small device pool and sits idle; the host tier is too small to park
    # it, so the next request waits with nothing running: the KV-pressure wedge
    s = Server(tmp_path, "--device-blocks", "48", "--host-bytes", "2MiB", "--drain-s", "0", name="kv",
               ledger=ledger).wait_ready()
    try:
        assert chat(s, "Tell me about the sea. " * 12, 200, session="idle").status_code == 200
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=chat(s, "And the mountains?", 500)))
        t.start()
        deadline = time.monotonic() + 30
        while waiting(s) < 1:
            assert time.monotonic() < deadline, "the second request never waited"
            time.sleep(0.2)
        findings = diagnosed(s, {"queued", "tier_full"}, after_s=10)    # tier_full's threshold: 10 s
    finally:
        s.stop()
        t.join(60)
    events, _ = read_ledger(s.ledger)
    [queued_row] = [r for r in events if type(r.event) is ev.RequestQueued]
    refusals = [r for r in events if type(r.event) is ev.MoveRefused and r.event.session == "idle"]
    assert queued_row.event.parks == ["idle"] and refusals and refusals[0].event.tier == "host"
    [q] = [f for f in findings if f["detector"] == "queued"]
    assert q["severity"] == "critical" and q["until_ns"] is None
    assert q["detail"]["onset_seq"] == queued_row.seq and q["detail"]["num_running"] == 0
    assert "park of session(s) idle" in q["title"] and "host budget: asked" in q["title"]
    assert q["detail"]["park_refusal_seqs"] and set(q["detail"]["park_refusal_seqs"]) <= {r.seq for r in refusals}
    [full] = [f for f in findings if f["detector"] == "tier_full"]
    assert full["subject"] == "worker 0 host" and full["detail"]["onset_seq"] == refusals[0].seq
    assert full["detail"]["sessions"] == ["idle"] and full["detail"]["num_queued"] == 1
    assert full["detail"]["asked_bytes"] > full["detail"]["available_bytes"]


def test_two_users_chatting_with_think_time_under_the_defaults_raise_no_warning(tmp_path):
    # the defaults park an idle session after 2 s; each user thinks 3.5-4.5 s, so every turn after the
    # first finds its session parked and restores (or recomputes) it: the design working, not a wedge
    s = Server(tmp_path, "--drain-s", "0", name="chat").wait_ready()
    answers: list[int] = []

    def user(name: str, think_s: list[float]) -> None:
        history = []
        for i, pause in enumerate(think_s):
            history.append({"role": "user", "content": f"Turn {i} from {name}: tell me one more fact."})
            body = {"model": MODEL, "messages": history, "max_tokens": 16, "temperature": 0, "session_id": name}
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
            answers.append(r.status_code)
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            time.sleep(pause)

    try:
        # six turns: enough park/restore round trips of the same pages for the pendulum detector to
        # count them, if it took them for swings
        users = [threading.Thread(target=user, args=("alice", [3.5, 4.0, 3.5, 4.5, 3.5, 0])),
                 threading.Thread(target=user, args=("bob", [4.0, 3.5, 4.5, 3.5, 4.0, 0]))]
        for t in users:
            t.start()
        for t in users:
            t.join(120)
        findings = diagnose(s)
    finally:
        s.stop()
    assert answers == [200] * 12
    events, _ = read_ledger(s.ledger)
    assert any(type(r.event) is ev.SessionParked for r in events)       # the think time did park them
    loud = [f"{f['detector']}: {f['title']}" for f in findings if f["severity"] in ("warning", "critical")]
    assert not loud, loud
