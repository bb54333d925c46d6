"""Server-sent events that notice a client leaving, even while no token is being sent.

Starlette's StreamingResponse only learns of a disconnect when its next write fails (ASGI 2.4)
or cancels the body iterator without telling anyone why. A generation that waits for tokens must
be stopped the moment the client is gone, so its blocks are freed and the free is recorded:
``on_disconnect`` is called (synchronously, once) as soon as ``http.disconnect`` arrives or a
write fails; the body iterator is then cancelled.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def sse_data(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 headers: dict[str, str] | None = None):
        self.body_iterator = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = False

        def left() -> None:
            nonlocal gone
            if not gone:
                gone = True
                self.on_disconnect()

        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        left()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                left()
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    aclose = getattr(self.body_iterator, "aclose", None)
                    if aclose is not None:
                        await aclose()
