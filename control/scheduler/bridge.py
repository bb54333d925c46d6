"""Between two threads: the API's asyncio loop and the control process's loop thread.

A request lives in a ``RequestState``: the loop thread fills it (admission outcome, chunks), the API
reads it. Every hand-over to the asyncio side goes through ``call_soon_threadsafe``; nothing on
the loop thread ever waits for the API.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from residency.control.scheduler.port import BackendError, Chunk, GenerateRequest


class RequestState:
    """One request: created on the API thread, driven on the control loop thread."""

    def __init__(self, req: GenerateRequest, loop: asyncio.AbstractEventLoop):
        self.req = req
        self.loop = loop
        self.admitted: asyncio.Future = loop.create_future()
        self.chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        # loop-thread state
        self.phase = "new"              # new | tokenizing | waiting | restoring | running | done
        self.worker: int | None = None
        self.routed_from: int | None = None     # tokenized there, moved to ``worker`` (``Router``)
        self.token_ids: list[int] = []
        self.keys: list[str] = []
        self.max_tokens = 0
        # its Tokenized once tokenized (perhaps while held for its model): a request that starts
        # over (a flip moved its model out before it ran) is checked again, not tokenized again
        self.tokenized = None
        self.admit = None               # control.scheduler.core.Admit once admitted
        self.cancelled: str | None = None
        self.rank_failed: str | None = None     # a group's rank ended it with an error (named here)
        self.num_generated = 0
        self.wait_since_ns = 0
        self.wait_code, self.wait_reason = "insufficient_kv_capacity", ""     # the scheduler's last Wait
        self.parks_asked: set[str] = set()
        self.session = req.session      # the session it runs as: the client's, or a retained prefix's

    @property
    def request_id(self) -> str:
        return self.req.request_id

    # ------------------------------------------------------------------ loop thread -> API
    def _soon(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass                        # the API's loop is gone (server stopping): nobody to tell

    def accept(self) -> None:
        self._soon(lambda: self.admitted.done() or self.admitted.set_result(None))

    def reject(self, error: BackendError) -> None:
        self._soon(lambda: self.admitted.done() or self.admitted.set_exception(error))

    def push(self, chunk: Chunk) -> None:
        self._soon(self.chunks.put_nowait, chunk)


class Stream:
    """What ``Backend.submit`` returns: chunks until the one with ``finish_reason``."""

    def __init__(self, state: RequestState, cancel: Callable[[str, str], None]):
        self.state = state
        self.request_id = state.request_id
        self.model = state.req.model
        self._cancel = cancel
        self._done = False

    async def __aiter__(self):
        while True:
            chunk = await self.state.chunks.get()
            if chunk.finish_reason is not None:
                self._done = True
                yield chunk
                return
            yield chunk

    def cancel(self, reason: str) -> None:
        if not self._done:
            self._done = True
            self._cancel(self.request_id, reason)
