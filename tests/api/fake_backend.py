"""A backend at the edge of the API's unit tests: canned words, no model, no ledger."""
from __future__ import annotations

import asyncio

from residency.events.commands import TokenChoice, TokenLogprobs
from residency.control.scheduler.port import (
    BackendError, BackendStats, Chunk, GenerateRequest, Health, ModelCard, SessionInfo, UnknownSession, Usage,
)

MODEL = "fake-model"
MAX_CONTEXT = 64


class FakeStream:
    def __init__(self, req: GenerateRequest, words: list[str], prompt_tokens: int, delay_s: float):
        self.request_id = req.request_id
        self.model = req.model
        self.req = req
        self.words = words
        self.prompt_tokens = prompt_tokens
        self.delay_s = delay_s
        self.cancelled: str | None = None
        self.finished = False

    def cancel(self, reason: str) -> None:
        if not self.finished and self.cancelled is None:
            self.cancelled = reason

    async def __aiter__(self):
        n = 0
        for i, w in enumerate(self.words):
            if self.cancelled:
                break
            await asyncio.sleep(self.delay_s)
            n += 1
            stop = self.req.sampling.stop
            if stop and w.strip() in stop:
                self.finished = True
                yield Chunk(text="", token_ids=[], finish_reason="stop", usage=self._usage(n - 1))
                return
            last = i == len(self.words) - 1 or n == self.req.sampling.max_tokens
            lps = self._logprobs(i, w)
            if last:
                self.finished = True
                reason = "length" if n == self.req.sampling.max_tokens and i < len(self.words) - 1 else "stop"
                yield Chunk(text=w, token_ids=[i], finish_reason=reason, usage=self._usage(n), logprobs=lps)
                return
            yield Chunk(text=w, token_ids=[i], logprobs=lps)
        self.finished = True
        yield Chunk(text="", finish_reason="cancelled", usage=self._usage(n))

    def _logprobs(self, i: int, w: str) -> list[TokenLogprobs]:
        """Word i's logprob is -(i + 1) / 4; its alternatives are "alt0".. at -1, -2, ..."""
        k = self.req.sampling.logprobs
        if k is None:
            return []
        top = [TokenChoice(token_id=100 + j, text=f"alt{j}", token_bytes=f"alt{j}".encode(), logprob=-(j + 1.0))
               for j in range(k)]
        return [TokenLogprobs(chosen=TokenChoice(token_id=i, text=w, token_bytes=w.encode(), logprob=-(i + 1) / 4),
                              top=top)]

    def _usage(self, n: int) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=n, cached_tokens=0, restored_tokens=0,
                     computed_tokens=self.prompt_tokens)


class FakeBackend:
    def __init__(self, words=("Hello", ",", " world", "!"), delay_s: float = 0.0):
        self.words = list(words)
        self.delay_s = delay_s
        self.submitted: list[GenerateRequest] = []
        self.streams: list[FakeStream] = []
        self.tiers: dict[str, str] = {"known": "device"}      # session -> its tier

    def models(self):
        return [ModelCard(id=MODEL, max_context=MAX_CONTEXT, created=0)]

    async def submit(self, req: GenerateRequest):
        self.submitted.append(req)
        if req.messages is not None:
            prompt_tokens = sum(len(m.content.split()) + 2 for m in req.messages)
        else:
            prompt_tokens = len(req.prompt.split()) if req.prompt else len(req.prompt_token_ids or [])
        if prompt_tokens >= MAX_CONTEXT:
            raise BackendError(400, f"the prompt is {prompt_tokens} tokens; the context window is {MAX_CONTEXT}",
                               param="messages", code="context_length_exceeded")
        if prompt_tokens + req.sampling.max_tokens > MAX_CONTEXT:
            raise BackendError(400, "max_tokens is too large", param="max_tokens", code="context_length_exceeded")
        if req.session:
            self.tiers[req.session] = "device"
        s = FakeStream(req, self.words, prompt_tokens, self.delay_s)
        self.streams.append(s)
        return s

    def _info(self, session: str, move_id=None) -> SessionInfo:
        if session not in self.tiers:
            raise UnknownSession(session)
        return SessionInfo(session=session, tier=self.tiers[session], num_blocks=2, num_tokens=20, bytes=2048,
                           busy=False, last_used_ns=0, move_id=move_id)

    async def park(self, session: str, tier: str = "host"):
        self._info(session)
        self.tiers[session] = tier
        return self._info(session, move_id="m-1")

    async def restore(self, session: str):
        self._info(session)
        self.tiers[session] = "device"
        return self._info(session, move_id="m-2")

    async def session(self, session: str):
        return self._info(session)

    async def delete(self, session: str):
        info = self._info(session)
        del self.tiers[session]
        return info, info.bytes

    async def sessions(self, limit: int):
        names = sorted(self.tiers)
        return [self._info(s) for s in names[:limit]], len(names)

    def stats(self):
        return BackendStats(tier_used_bytes={("0", "device"): 4096}, tier_capacity_bytes={("0", "device"): 1 << 20},
                            moves={("park", "MoveAcked"): 1}, stranded_bytes=0, ledger_append_lag_s=0.001)

    def health(self):
        return Health(ok=True, detail={"model": MODEL})
