"""Ctrl-C or SIGTERM drains ``residency serve``: new requests get 503 ``server_shutting_down``
and /health 503, accepted ones finish (``--drain-s``, 30 s by default), then everything stops
by the book."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model


def _stream(server: Server, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    chunks, done = [], False
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 3:
                        started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out.update(chunks=chunks, done=done)
    started.set()


def test_a_signal_lets_accepted_requests_finish_and_refuses_new_ones(tmp_path):
    s = Server(tmp_path).wait_ready()
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s, 60, out, started))
    t.start()
    assert started.wait(60)
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(f"{s.url}/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "never started draining"
        time.sleep(0.05)
    assert "\nresidency_draining 1.0\n" in httpx.get(f"{s.url}/metrics", timeout=10).text
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    t.join(60)
    assert s.stop() == 0
    assert out["done"] and "error" not in out
    assert [c["choices"][0]["finish_reason"] for c in out["chunks"] if c["choices"]][-1] == "length"
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    finished = [r.event for r in events if type(r.event) is ev.RequestFinished]
    assert [(f.reason, f.completion_tokens) for f in finished] == [("length", 60)]
    assert type(events[-1].event) is ev.ServerStopped


def test_past_the_drain_time_a_running_request_is_cut_and_the_stop_is_clean(tmp_path):
    s = Server(tmp_path, "--drain-s", "0.5").wait_ready()
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s, 2500, out, started))
    t.start()
    assert started.wait(60) and "chunks" not in out, out      # still streaming (not refused, not done)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert s.stop() == 0
    assert "serve_drain_cut" in s.log_path.read_text()
    # the client is told why its answer ends early (not a reset connection) ...
    assert "error" not in out and out["done"], out
    assert "the server stopped" in out["chunks"][-1]["error"]["message"]
    # ... and the ledger closes the request before the stop: nothing stays open there
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    assert type(events[-1].event) is ev.ServerStopped
    [finished] = [r for r in events if type(r.event) is ev.RequestFinished]
    assert finished.event.reason == "server_stopped" and 0 < finished.event.completion_tokens < 2500
    admitted = {r.event.request_id for r in events if type(r.event) is ev.RequestAdmitted}
    assert admitted == {finished.event.request_id}


def _metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_a_request_still_waiting_for_room_at_the_stop_is_refused_and_closed_in_the_ledger(tmp_path):
    # 192 device pages; each request reserves its prompt and 2500 tokens (~160 pages): one runs, one waits
    s = Server(tmp_path, "--drain-s", "0.5").wait_ready()
    out: dict = {}
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s, 2500, out, started))
    t.start()
    assert started.wait(60)
    waiting: dict = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Another long story."}], "max_tokens": 2500,
            "ignore_eos": True}
    w = threading.Thread(target=lambda: waiting.update(r=httpx.post(f"{s.url}/v1/chat/completions", json=body,
                                                                     timeout=120)))
    w.start()
    deadline = time.monotonic() + 30
    while _metric(s, "residency_requests_waiting") < 1:
        assert time.monotonic() < deadline, "the second request never waited"
        time.sleep(0.1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    w.join(60)
    assert s.stop() == 0
    r = waiting["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_stopped", r.text
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    [queued] = [x for x in events if type(x.event) is ev.RequestQueued]
    [refused] = [x for x in events if type(x.event) is ev.RequestRefused]
    [finished] = [x for x in events if type(x.event) is ev.RequestFinished]
    assert refused.event.request_id == queued.event.request_id and refused.event.reason.startswith("server_stopped")
    assert finished.event.reason == "server_stopped" and finished.event.request_id != queued.event.request_id
    assert queued.seq < refused.seq < events[-1].seq and type(events[-1].event) is ev.ServerStopped
