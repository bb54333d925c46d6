"""Slow, greedy and vanishing clients, over a real socket to the app served as ``residency serve``
serves it (tests/api/fake_server.py: uvicorn via ``start_api``, the serve log set-up, the fake
backend at the edge). The server's stderr is its log, read as an operator reads serve's."""
from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.fake_backend import MODEL

MAX_BODY_BYTES = 4096
BODY_TIMEOUT_S = 1.0
LIVENESS_S = 20.0            # a deadline for answers that must come, not a speed claim
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.api.fake_server", str(self.port),
                                      str(MAX_BODY_BYTES), str(BODY_TIMEOUT_S)],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=self.log)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().strip() if ready else b""
        if line != b"ready":
            self.stop()
            raise RuntimeError(f"the fake server did not start ({line!r}):\n{self.stderr()}")

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(LIVENESS_S)
        return s

    def metric(self, needle: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=LIVENESS_S).text.splitlines():
            if line.startswith(needle + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_metric(self, needle: str, at_least: float) -> None:
        deadline = time.monotonic() + LIVENESS_S
        while self.metric(needle) < at_least:
            assert time.monotonic() < deadline, (f"{needle} never reached {at_least}:\n{self.stderr()}\n"
                                                 + httpx.get(f"{self.url}/metrics").text)
            time.sleep(0.05)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = Live(tmp_path_factory.mktemp("api-live"))
    yield server
    server.stop()


def _head(path: str, extra: str = "", length: int | None = None) -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else ""
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{cl}{extra}\r\n").encode()


def _chat_body(**kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (h.split(":", 1) for h in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def _still_serving(live: Live) -> None:
    r = httpx.post(f"{live.url}/v1/chat/completions", json=json.loads(_chat_body(max_tokens=2)), timeout=LIVENESS_S)
    assert r.status_code == 200, r.text


def _assert_error(raw: bytes, status: int, code: str) -> None:
    got, headers, body = _parse(raw)
    assert got == status, raw
    assert headers.get("connection") == "close"
    assert json.loads(body)["error"]["code"] == code


def test_a_body_shorter_than_its_content_length_is_answered_408_and_its_connection_closed(live):
    body = _chat_body()
    with live.connect() as s:
        s.sendall(_head("/v1/chat/completions", length=len(body) + 50) + body)
        raw = _read_until_closed(s)         # returns only once the server has closed its end
    _assert_error(raw, 408, "request_timeout")
    assert f"{len(body)} bytes of the {len(body) + 50} promised" in json.loads(_parse(raw)[2])["error"]["message"]
    live.wait_metric('residency_http_requests_total{route="unmatched",status="408"}', 1)
    _still_serving(live)


def test_a_declared_body_over_the_limit_is_413_without_waiting_for_it(live):
    with live.connect() as s:
        s.sendall(_head("/v1/chat/completions", length=MAX_BODY_BYTES + 1))    # and not one byte of it
        raw = _read_until_closed(s)
    _assert_error(raw, 413, "request_too_large")


def test_a_chunked_body_that_grows_over_the_limit_is_413(live):
    piece = b"x" * 1000
    with live.connect() as s:
        s.sendall(_head("/v1/completions", extra="Transfer-Encoding: chunked\r\n"))
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        raw = _read_until_closed(s)         # no final zero-size chunk: the server stops reading first
    _assert_error(raw, 413, "request_too_large")
    _still_serving(live)


def test_a_body_at_the_limit_is_served(live):
    body = _chat_body(max_tokens=2)
    body = body[:-1] + b"," + b'"user":"' + b"u" * (MAX_BODY_BYTES - len(body) - 10) + b'"}'
    assert len(body) == MAX_BODY_BYTES
    r = httpx.post(f"{live.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=LIVENESS_S)
    assert r.status_code == 200, r.text


def test_clients_that_leave_mid_body_or_mid_answer_leave_no_error_in_the_log(live):
    before_left = live.metric('residency_http_requests_total{route="unmatched",status="499"}')
    before_cut = live.metric('residency_generations_finished_total{reason="disconnected"}')
    # 1. mid-body: the headers promise more than comes before the client goes
    body = _chat_body()
    with live.connect() as s:
        s.sendall(_head("/v1/chat/completions", length=len(body)) + body[:10])
        time.sleep(0.2)
    live.wait_metric('residency_http_requests_total{route="unmatched",status="499"}', before_left + 1)
    # 2. mid-stream: after the first tokens
    with live.connect() as s:
        body = _chat_body(stream=True)
        s.sendall(_head("/v1/chat/completions", length=len(body)) + body)
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += s.recv(65536)
    live.wait_metric('residency_generations_finished_total{reason="disconnected"}', before_cut + 1)
    # 3. mid-generation of an answer sent whole
    with live.connect() as s:
        body = json.dumps({"model": MODEL, "prompt": "once upon", "max_tokens": 50}).encode()
        s.sendall(_head("/v1/completions", length=len(body)) + body)
        time.sleep(0.2)
    live.wait_metric('residency_http_requests_total{route="/v1/completions",status="499"}', 1)
    live.wait_metric('residency_generations_finished_total{reason="disconnected"}', before_cut + 2)
    assert live.metric('residency_generations_finished_total{reason="unknown"}') == 0
    _still_serving(live)
    log = live.stderr()
    for needle in ("Traceback", "unhandled", "Exception in ASGI", '"level": "error"', '"level":"error"'):
        assert needle not in log, log
