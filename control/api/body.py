"""A request body is read whole, within a size and a time, before any route sees it.

uvicorn waits as long as a client likes for the bytes its ``Content-Length`` promised, and
accepts a body of any size. A client that promises more than it sends would hold its connection
(and the task serving it) forever; one that sends gigabytes would fill our memory. So this layer
reads the body itself, then replays it to the app:

    headers ─► Content-Length > limit?  ── 413, nothing read
            ─► read chunks until more_body is False
                 ├ more than the limit so far   ── 413
                 ├ not done by the deadline     ── 408
                 └ the client left              ── nothing to answer (counted as 499)
            ─► app(receive = the buffered body, then the server's own receive)

408 and 413 close the connection: the unread rest of the body would otherwise be parsed as the
next request. Every route here reads its body whole, so buffering costs nothing they did not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import anyio
import structlog

from residency.control.api.errors import error_body

log = structlog.get_logger("residency.api")

DEFAULT_MAX_BODY_BYTES = 8 << 20      # a full context of token ids or text is far below this
DEFAULT_BODY_TIMEOUT_S = 30.0

CLIENT_CLOSED_REQUEST = 499           # nginx's status for "the client left first"; nobody reads it


@dataclass(frozen=True)
class BodyRefused:
    """Why a body was not taken: the answer to send instead of running the app."""
    status: int
    message: str
    code: str


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None              # the server's HTTP parser refuses these before we run
    return None


class BoundedBody:
    """Pure ASGI middleware: bounds every HTTP request body by ``max_bytes`` and ``timeout_s``."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await self._read(scope, receive)
        if isinstance(body, BodyRefused):
            log.info("api_body_refused", path=scope.get("path"), status=body.status, code=body.code)
            return await _answer(send, body)

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()       # after the body: only http.disconnect is left to come

        await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes | BodyRefused:
        """The whole body, or why not: too large (413), too slow (408), the client left (499)."""
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            return BodyRefused(413, f"the request body is {declared} bytes; this server accepts at most "
                                f"{self.max_bytes}", "request_too_large")
        parts: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return BodyRefused(CLIENT_CLOSED_REQUEST, "the client left before its body was whole",
                                       "client_disconnected")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return BodyRefused(413, f"the request body passed {self.max_bytes} bytes, the most this server "
                                        "accepts", "request_too_large")
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)
        promised = f" of the {declared} promised" if declared is not None else ""
        return BodyRefused(408, f"the request body did not arrive within {self.timeout_s:g} s ({size} bytes{promised} "
                            "came)", "request_timeout")


async def _answer(send, e: BodyRefused) -> None:
    payload = json.dumps(error_body(e.message, "invalid_request_error", None, e.code)).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
