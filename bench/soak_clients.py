"""The clients of bench/soak.py: honest multi-turn sessions, and the hostile inputs of issue #26.

Every call returns one ``Outcome``: what was sent (``kind``) and how it ended (``result``):

  2xx, 4xx, 5xx   the server answered with that status class (a stream counts as answered when its
                  last event, ``[DONE]``, arrived; ``stream_cut`` otherwise)
  500             apart from the other 5xx: an error the server did not expect (a lost worker, for
                  one, should be a 503 the client may retry)
  stream_error    a stream that began and then carried an error event (answered, with the reason)
  no_server       nobody listened on the port (the control process was down): never received
  cut             the connection broke before an answer (the server process died under it)
  client_closed   this client hung up on purpose (a stream dropped after its first chunks)
  unanswered      no answer within the client's timeout: the failure the soak exists to find

A client never retries: each request is counted once, as the server treated it.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
from sse_chunks import SseChunks

MODEL = "SmolLM2-135M-Instruct"

TOPICS = ("the tides", "bread", "a lighthouse keeper", "prime numbers", "the moon", "bees", "glaciers",
          "a chess opening", "rivers", "a city at night", "an old clock", "volcanoes")


@dataclass
class Outcome:
    kind: str
    result: str
    status: int | None = None
    seconds: float = 0.0
    detail: str = ""
    request_id: str | None = None


@dataclass
class Sessions:
    """The session ids honest clients are using now: the targets of hostile parks and deletes."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: set[str] = field(default_factory=set)

    def add(self, sid: str) -> None:
        with self.lock:
            self.live.add(sid)

    def discard(self, sid: str) -> None:
        with self.lock:
            self.live.discard(sid)

    def pick(self, rng: random.Random) -> str | None:
        with self.lock:
            return rng.choice(sorted(self.live)) if self.live else None


def _classify_status(code: int) -> str:
    return "500" if code == 500 else f"{code // 100}xx"


class Client:
    """One simulated user on its own thread: honest turns with think time, and now and then a
    hostile request drawn from ``hostile_kinds``."""

    def __init__(self, idx: int, url: str, admin_key: str, rng: random.Random, sessions: Sessions,
                 timeout_s: float, hostile_fraction: float, hostile_kinds: list[str], think_s: float,
                 oversize_bytes: int, record):
        self.idx, self.url, self.admin_key, self.rng = idx, url, admin_key, rng
        self.sessions, self.timeout_s, self.record = sessions, timeout_s, record
        self.hostile_fraction, self.hostile_kinds = hostile_fraction, hostile_kinds
        self.think_s, self.oversize_bytes = think_s, oversize_bytes
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.num_sessions = 0

    # ------------------------------------------------------------------ the loop
    def run(self, stop_at: float) -> None:
        try:
            while time.monotonic() < stop_at:
                if self.hostile_kinds and self.rng.random() < self.hostile_fraction:
                    kind = self.rng.choice(self.hostile_kinds)
                    self.record(self._timed(kind, getattr(self, "hostile_" + kind)))
                    time.sleep(self.rng.uniform(0, self.think_s / 2))
                else:
                    self.conversation(stop_at)
        finally:
            self.http.close()

    def conversation(self, stop_at: float) -> None:
        """A session of a few turns, each one the whole history plus a new question."""
        self.num_sessions += 1
        sid = f"soak-c{self.idx}-s{self.num_sessions}"
        self.sessions.add(sid)
        messages = [{"role": "system", "content": "You are brief. You answer in one or two sentences."}]
        try:
            for turn in range(self.rng.randint(2, 5)):
                if time.monotonic() >= stop_at:
                    return
                messages.append({"role": "user", "content": f"Tell me one thing about {self.rng.choice(TOPICS)}."})
                body = {"model": MODEL, "messages": messages, "max_tokens": self.rng.randint(6, 20),
                        "temperature": self.rng.choice([0, 0.7]), "seed": self.rng.randint(0, 1 << 30)}
                stream = self.rng.random() < 0.5
                out = self._timed("valid_stream" if stream else "valid",
                                  lambda: self._chat(body, sid, stream))
                self.record(out)
                if out.result != "2xx":
                    # the history is unknown to the server now: start afresh, after a pause as a
                    # person (or a client library's back-off) would take
                    time.sleep(self.rng.uniform(0.5, 1.0) * self.think_s)
                    return
                messages.append({"role": "assistant", "content": out.detail or "..."})
                time.sleep(self.rng.uniform(0.2, self.think_s))
        finally:
            self.sessions.discard(sid)

    # ------------------------------------------------------------------ plumbing
    def _timed(self, kind: str, fn) -> Outcome:
        t0 = time.monotonic()
        try:
            out = fn()
        except (httpx.ConnectError, ConnectionRefusedError) as e:
            out = Outcome(kind, "no_server", detail=str(e)[:200])
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout, socket.timeout, TimeoutError) as e:
            out = Outcome(kind, "unanswered", detail=f"{type(e).__name__} after {self.timeout_s} s")
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, ConnectionError) as e:
            out = Outcome(kind, "cut", detail=f"{type(e).__name__}: {str(e)[:160]}")
        out.kind = kind
        out.seconds = time.monotonic() - t0
        return out

    def _post(self, path: str, content: bytes, headers: dict | None = None) -> Outcome:
        r = self.http.post(self.url + path, content=content,
                           headers={"Content-Type": "application/json", **(headers or {})})
        return self._answered(r)

    def _answered(self, r: httpx.Response) -> Outcome:
        detail, rid = "", None
        try:
            body = r.json()
            rid = body.get("id") if isinstance(body, dict) else None
            err = body.get("error") if isinstance(body, dict) else None
            if isinstance(err, dict):
                detail = f"{err.get('code')}: {str(err.get('message'))[:160]}"
        except ValueError:
            detail = r.text[:160]
        return Outcome("", _classify_status(r.status_code), r.status_code, detail=detail, request_id=rid)

    def _chat(self, body: dict, sid: str | None, stream: bool) -> Outcome:
        headers = {"X-Session-Id": sid} if sid else {}
        if not stream:
            r = self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers)
            out = self._answered(r)
            if r.status_code == 200:
                out.detail = r.json()["choices"][0]["message"]["content"] or ""
            return out
        text, rid = [], None
        with self.http.stream("POST", self.url + "/v1/chat/completions", json={**body, "stream": True},
                              headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return self._answered(r)
            chunks = SseChunks(r.iter_lines())
            for chunk in chunks:
                rid = chunk.get("id", rid)
                if chunk.get("error"):
                    return Outcome("", "stream_error", 200, detail=f"error in stream: {str(chunk['error'])[:160]}",
                                   request_id=rid)
                for ch in chunk.get("choices") or []:
                    text.append((ch.get("delta") or {}).get("content") or "")
        if not chunks.done:
            return Outcome("", "stream_cut", 200, detail="the stream ended without [DONE]", request_id=rid)
        return Outcome("", "2xx", 200, detail="".join(text), request_id=rid)

    def _small_chat(self, **extra) -> dict:
        return {"model": MODEL, "max_tokens": 8,
                "messages": [{"role": "user", "content": f"Say something about {self.rng.choice(TOPICS)}."}], **extra}

    # ------------------------------------------------------------------ hostile requests (issue #26)
    def hostile_tiny_temperature(self) -> Outcome:
        return self._post("/v1/chat/completions", json.dumps(self._small_chat(temperature=1e-300)).encode())

    def hostile_tiny_top_p(self) -> Outcome:
        return self._post("/v1/chat/completions", json.dumps(self._small_chat(temperature=2, top_p=1e-300)).encode())

    def hostile_lone_surrogate(self) -> Outcome:
        body = self._small_chat()
        body["messages"][0]["content"] += " \ud800 end"
        return self._post("/v1/chat/completions", json.dumps(body, ensure_ascii=True).encode())

    def hostile_huge_token_id(self) -> Outcome:
        body = {"model": MODEL, "max_tokens": 4, "prompt": [1, 2, self.rng.choice([1 << 64, (1 << 64) + 5])]}
        return self._post("/v1/completions", json.dumps(body).encode())

    def hostile_unknown_fields(self) -> Outcome:
        body = self._small_chat(presence_penalty=0.5, frobnicate=True, response_format={"type": "json_object"},
                                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        return self._post("/v1/chat/completions", json.dumps(body).encode())

    def hostile_malformed_json(self) -> Outcome:
        return self._post("/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": ')

    def hostile_oversize_body(self) -> Outcome:
        filler = "".join(self.rng.choice("abcdefgh ") for _ in range(4096))
        content = (filler * (self.oversize_bytes // len(filler) + 1))[:self.oversize_bytes]
        return self._post("/v1/chat/completions", json.dumps(self._small_chat() | {
            "messages": [{"role": "user", "content": content}]}).encode())

    def hostile_short_body(self) -> Outcome:
        """Headers promise more body than is ever sent; then the client waits for an answer."""
        host, port = self.url.removeprefix("http://").split(":")
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: 4096\r\nConnection: close\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.settimeout(self.timeout_s)
            s.sendall(head + b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4')
            data = s.recv(4096)
        if not data:
            return Outcome("", "cut", detail="closed without a status line")
        try:
            code = int(data.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return Outcome("", "cut", detail=f"not HTTP: {data[:60]!r}")
        return Outcome("", _classify_status(code), code, detail=data.split(b"\r\n", 1)[0].decode(errors="replace"))

    def hostile_disconnect_mid_stream(self) -> Outcome:
        body = self._small_chat(stream=True, max_tokens=64, ignore_eos=True)
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return self._answered(r)
            rid = None
            for n, line in enumerate(r.iter_lines()):
                if line.startswith("data: {"):
                    rid = json.loads(line[6:]).get("id", rid)
                if n >= 4:
                    break
        return Outcome("", "client_closed", 200, detail="hung up after the first chunks", request_id=rid)

    def _admin(self, method: str, path: str, **kw) -> Outcome:
        r = self.http.request(method, self.url + path, headers={"Authorization": f"Bearer {self.admin_key}"}, **kw)
        return self._answered(r)

    def hostile_delete_session(self) -> Outcome:
        sid = self.sessions.pick(self.rng) or f"soak-none-{self.rng.randint(0, 99)}"
        return self._admin("DELETE", f"/admin/sessions/{sid}")

    def hostile_park_session(self) -> Outcome:
        sid = self.sessions.pick(self.rng) or f"soak-none-{self.rng.randint(0, 99)}"
        return self._admin("POST", f"/admin/sessions/{sid}/park", json={"tier": self.rng.choice(["host", "disk"])})


HOSTILE_KINDS = [name.removeprefix("hostile_") for name in vars(Client) if name.startswith("hostile_")]
