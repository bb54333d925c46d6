"""A request queued for room always ends in the ledger: against a real ``residency serve``, one
waits behind a long generation and then its worker is killed, or its client leaves."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model

# 192 device pages; each request reserves its prompt and 2500 tokens (~160 pages): one runs, one waits
LONG = 2500


def _post(server: Server, text: str, out: dict, timeout: float = 120) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": LONG, "ignore_eos": True}
    try:
        out["r"] = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)
    except httpx.HTTPError as e:
        out["error"] = e


def _waiting(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("residency_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no residency_requests_waiting metric")


def _one_running_one_queued(server: Server) -> tuple[dict, dict, list[threading.Thread]]:
    running, queued = {}, {}
    threads = [threading.Thread(target=_post, args=(server, "Write a long story.", running))]
    threads[0].start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("residency_requests_running 1") for line in
                  httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()):
        assert time.monotonic() < deadline, "the first request never ran"
        time.sleep(0.1)
    return running, queued, threads


def _until_queued(server: Server) -> None:
    deadline = time.monotonic() + 30
    while _waiting(server) < 1:
        assert time.monotonic() < deadline, "the second request never waited"
        time.sleep(0.1)


def test_a_queued_request_whose_worker_is_lost_is_refused_and_closed(tmp_path):
    s = Server(tmp_path).wait_ready()
    try:
        running, queued, threads = _one_running_one_queued(s)
        threads.append(threading.Thread(target=_post, args=(s, "Another long story.", queued)))
        threads[-1].start()
        _until_queued(s)
        os.kill(int((s.dir / "run" / "worker-0.pid").read_text().split()[0]), signal.SIGKILL)
        for t in threads:
            t.join(60)
        r = queued["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_lost", r.text
    finally:
        s.stop()
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    [q] = [x for x in events if type(x.event) is ev.RequestQueued]
    [lost] = [x for x in events if type(x.event) is ev.WorkerLost]
    [refused] = [x for x in events if type(x.event) is ev.RequestRefused]
    assert refused.event.request_id == q.event.request_id and refused.event.reason.startswith("worker_lost")
    assert q.seq < lost.seq < refused.seq


def test_a_queued_request_whose_client_leaves_is_finished_by_the_client_and_closed(tmp_path):
    s = Server(tmp_path, "--drain-s", "0.5").wait_ready()
    try:
        running, queued, threads = _one_running_one_queued(s)
        threads.append(threading.Thread(target=_post, args=(s, "Another long story.", queued, 3.0)))
        threads[-1].start()
        _until_queued(s)
        threads[-1].join(30)
        assert isinstance(queued.get("error"), httpx.TimeoutException)      # the client gave up and left
        deadline = time.monotonic() + 30
        while _waiting(s) > 0:
            assert time.monotonic() < deadline, "the request of a client that left is still waiting"
            time.sleep(0.1)
    finally:
        s.stop()
        for t in threads:
            t.join(60)
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    [q] = [x for x in events if type(x.event) is ev.RequestQueued]
    [left] = [x for x in events if type(x.event) is ev.RequestFinished and x.event.request_id == q.event.request_id]
    assert left.event.reason == "disconnected" and left.event.completion_tokens == 0
    assert not [x for x in events if type(x.event) is ev.RequestRefused]
