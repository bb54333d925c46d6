"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``: the OpenAI wire format.

A handler validates, turns the body into a ``GenerateRequest``, and asks the backend to admit
it. Admission errors come back as a proper HTTP status before any byte of a stream is sent.
Then it relays chunks: as SSE ``data:`` lines (ending with ``[DONE]``) or collected into one
JSON response. A client that leaves mid-way cancels its generation (blocks freed, recorded).
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from residency.control.api.choices import Choices, choice_requests, total_usage
from residency.control.api.errors import ApiError
from residency.control.api.logprobs import CompletionLogprobs, chat_logprobs
from residency.control.api.metrics import TokenClock
from residency.control.api.schemas import SESSION_ID_RE, ChatCompletionBody, CompletionBody, parse_json, validate
from residency.control.api.sse import SSE_DONE, SSEResponse, sse_data
from residency.control.scheduler.port import BackendError, Chunk, GenerateRequest, GenerationStream, Usage
from residency.events.commands import ChatTurn, SamplingParams

router = APIRouter()


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "restored_tokens": u.restored_tokens,
        "computed_tokens": u.computed_tokens,
        "shared_tokens": u.shared_tokens,
    }


def _session_of(request: Request, body) -> str | None:
    """The session a request names: the body's ``session_id`` or the ``X-Session-Id`` header."""
    header = (request.headers.get("x-session-id") or "").strip() or None
    if header is not None and body.session_id is not None and header != body.session_id:
        raise ApiError(400, "X-Session-Id header and session_id field name different sessions", param="session_id",
                       code="invalid_value")
    if header is not None and not SESSION_ID_RE.match(header):
        raise ApiError(400, "X-Session-Id must be 1-128 characters of [A-Za-z0-9._:@-]", param="session_id",
                       code="invalid_value")
    return body.session_id or header


def _check_model(request: Request, model: str) -> None:
    backend = request.app.state.backend
    models = backend.models()
    if not models:
        raise ApiError(503, "the model is still loading; retry shortly", type="server_error", code="model_loading")
    if model not in {m.id for m in models}:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(repr(m.id) for m in models)}", param="model", code="model_not_found")


def _sampling(body, max_tokens: int | None) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 0,   # 0: the backend fills in the context's rest
        temperature=temperature,
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        stop=list(body.stop or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_k,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias or {},
    )


async def _start(request: Request, reqs: list[GenerateRequest]) -> Choices:
    """Admit every choice; if one is refused, the ones admitted are cancelled and the refusal raised.

    A request may wait a long time for room before it is admitted: a client that leaves meanwhile
    cancels it there and then (the backend closes it in the ledger), rather than when it is admitted."""
    streams: list[GenerationStream] = []
    left = anyio.Event()

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left.set()
        scope.cancel()          # the backend's submit, cancelled, withdraws the request

    refused: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            try:
                for req in reqs:
                    streams.append(await request.app.state.backend.submit(req))
            except Exception as e:      # raised below as it is, not wrapped in the task group's ExceptionGroup
                refused = e
            tg.cancel_scope.cancel()
    except BaseException:
        for st in streams:
            st.cancel("the request was cancelled")
        raise
    if refused is not None or left.is_set():
        for st in streams:
            st.cancel("a sibling choice was refused" if refused is not None else "disconnected")
        raise refused or ApiError(499, "client disconnected", code="client_disconnected")
    return Choices(streams)


async def _watch_disconnect(request: Request, choices: Choices, scope: anyio.CancelScope, gone: anyio.Event) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            choices.cancel("disconnected")
            scope.cancel()
            return


class Collected:
    """One choice, gathered: its text, last chunk and logprobs."""

    __slots__ = ("parts", "last", "logprobs")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.last: Chunk | None = None
        self.logprobs: list = []

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def _collect(request: Request, choices: Choices, endpoint: str, t0: float) -> list[Collected]:
    """Gather every choice to its end; a client that leaves meanwhile cancels them."""
    clock = TokenClock(request.app.state.metrics, endpoint, t0)
    out = [Collected() for _ in choices.streams]
    gone = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_disconnect, request, choices, tg.cancel_scope, gone)
        try:
            async for i, chunk in choices.merged():
                clock.tokens(i, len(chunk.token_ids), time.perf_counter())
                c = out[i]
                c.parts.append(chunk.text)
                c.logprobs += chunk.logprobs
                c.last = chunk
        finally:
            choices.cancel("disconnected")      # no-op once finished
            tg.cancel_scope.cancel()
    # the watcher cancels the loop above without an error: a choice cut short says the client left
    unfinished = sum(c.last is None or c.last.finish_reason is None for c in out)
    if unfinished and gone.is_set():
        request.app.state.metrics.finished.labels("disconnected").inc(unfinished)
        raise ApiError(499, "client disconnected", code="client_disconnected")
    if unfinished:
        raise ApiError(500, f"{unfinished} of {len(out)} generations ended without a finish reason",
                       type="server_error", code="generation_incomplete")
    return out


def _finish(request: Request, collected: list[Collected]) -> Usage | None:
    """Count the choices' ends; a failed one fails the request. Returns the request's usage."""
    metrics = request.app.state.metrics
    for c in collected:
        metrics.finished.labels(c.last.finish_reason or "unknown").inc()
    usage = total_usage([c.last.usage for c in collected])
    metrics.observe_usage(usage)
    failed = next((c.last for c in collected if c.last.finish_reason == "error"), None)
    if failed is not None:       # the server's state (a lost worker) is retryable; a failed step is our bug
        raise BackendError(failed.status or 500, f"generation failed: {failed.error}", type="server_error",
                           code=failed.code or "generation_failed", retry_after_s=failed.retry_after_s)
    return usage


async def _sse(request: Request, choices: Choices, endpoint: str, t0: float, render, include_usage: bool,
               head: list[bytes]) -> AsyncIterator[bytes]:
    metrics = request.app.state.metrics
    clock = TokenClock(metrics, endpoint, t0)
    usages: list[Usage | None] = [None] * len(choices.streams)
    left = len(usages)
    try:
        for h in head:
            yield h
        async for i, chunk in choices.merged():
            clock.tokens(i, len(chunk.token_ids), time.perf_counter())
            if chunk.finish_reason is not None:
                left -= 1
                usages[i] = chunk.usage
                metrics.finished.labels(chunk.finish_reason).inc()
                if chunk.finish_reason == "error":
                    yield sse_data({"error": {"message": f"generation failed: {chunk.error}", "type": "server_error",
                                              "param": None, "code": chunk.code or "generation_failed"}})
                    yield SSE_DONE
                    return
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs:
                yield sse_data(render(chunk, i))
        usage = total_usage(usages)
        metrics.observe_usage(usage)
        if include_usage and usage is not None:
            yield sse_data(render(None, 0, usage=usage))
        yield SSE_DONE
    finally:
        for _ in range(left):
            metrics.finished.labels("disconnected").inc()
        choices.cancel("disconnected")          # no-op for the choices that finished


def _check_n(body, session: str | None) -> int:
    n = body.n or 1
    if n > 1 and session is not None:
        raise ApiError(400, "n > 1 cannot continue a session: each choice would be a different next turn",
                       param="n", code="invalid_value")
    return n


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    t0 = time.perf_counter()
    body: ChatCompletionBody = validate(ChatCompletionBody, parse_json(await request.body()))
    session = _session_of(request, body)
    n = _check_n(body, session)
    _check_model(request, body.model)
    max_tokens = body.effective_max_tokens
    req = GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        kind="chat",
        model=body.model,
        sampling=_sampling(body, max_tokens),
        messages=[ChatTurn(role=m.role, content=m.text()) for m in body.messages],
        session=session,
        max_tokens_given=max_tokens is not None,
    )
    choices = await _start(request, choice_requests(req, n))
    created = int(time.time())
    extra = {"session_id": session} if session else {}
    headers = {"X-Request-Id": req.request_id, **({"X-Session-Id": session} if session else {})}

    want_logprobs = body.logprobs_k is not None
    if body.stream:
        def render(chunk: Chunk | None, index: int, usage: Usage | None = None) -> dict:
            base = {"id": req.request_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    **extra}
            if chunk is None:
                return {**base, "choices": [], "usage": usage_json(usage)}
            delta = {"content": chunk.text} if chunk.text else {}
            lp = chat_logprobs(chunk.logprobs) if want_logprobs and chunk.logprobs else None
            return {**base, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                         "finish_reason": chunk.finish_reason}]}

        head = [sse_data({"id": req.request_id, "object": "chat.completion.chunk", "created": created,
                          "model": body.model, **extra,
                          "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}) for i in range(n)]
        return SSEResponse(_sse(request, choices, "chat", t0, render, body.include_usage, head),
                           on_disconnect=lambda: choices.cancel("disconnected"), headers=headers)

    collected = await _collect(request, choices, "chat", t0)
    usage = _finish(request, collected)
    return JSONResponse({
        "id": req.request_id, "object": "chat.completion", "created": created, "model": body.model, **extra,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                     "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                     "finish_reason": c.last.finish_reason} for i, c in enumerate(collected)],
        "usage": usage_json(usage) if usage else None,
    }, headers=headers)


@router.post("/v1/completions")
async def completions(request: Request):
    t0 = time.perf_counter()
    body: CompletionBody = validate(CompletionBody, parse_json(await request.body()))
    session = _session_of(request, body)
    n = _check_n(body, session)
    _check_model(request, body.model)
    max_tokens = body.effective_max_tokens
    if max_tokens is None:
        max_tokens = 16                        # the OpenAI default for legacy completions
    req = GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex[:24]}",
        kind="completion",
        model=body.model,
        sampling=_sampling(body, max_tokens),
        prompt=body.prompt if isinstance(body.prompt, str) else None,
        prompt_token_ids=list(body.prompt) if isinstance(body.prompt, list) else None,
        session=session,
        max_tokens_given=True,
    )
    choices = await _start(request, choice_requests(req, n))
    created = int(time.time())
    extra = {"session_id": session} if session else {}
    headers = {"X-Request-Id": req.request_id, **({"X-Session-Id": session} if session else {})}

    lp_shapes = [CompletionLogprobs() for _ in range(n)] if body.logprobs_k is not None else None
    if body.stream:
        def render(chunk: Chunk | None, index: int, usage: Usage | None = None) -> dict:
            base = {"id": req.request_id, "object": "text_completion", "created": created, "model": body.model, **extra}
            if chunk is None:
                return {**base, "choices": [], "usage": usage_json(usage)}
            lp = lp_shapes[index].render(chunk.logprobs) if lp_shapes is not None else None
            return {**base, "choices": [{"index": index, "text": chunk.text, "logprobs": lp,
                                         "finish_reason": chunk.finish_reason}]}

        return SSEResponse(_sse(request, choices, "completions", t0, render, body.include_usage, []),
                           on_disconnect=lambda: choices.cancel("disconnected"), headers=headers)

    collected = await _collect(request, choices, "completions", t0)
    usage = _finish(request, collected)
    return JSONResponse({
        "id": req.request_id, "object": "text_completion", "created": created, "model": body.model, **extra,
        "choices": [{"index": i, "text": c.text,
                     "logprobs": lp_shapes[i].render(c.logprobs) if lp_shapes is not None else None,
                     "finish_reason": c.last.finish_reason} for i, c in enumerate(collected)],
        "usage": usage_json(usage) if usage else None,
    }, headers=headers)


def _card(m) -> dict:
    """A model as /v1/models lists it; ``residency`` (resident, asleep, host, file) and
    ``arena_gen`` say where its weights are, when the server knows (issue #28)."""
    out = {"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by, "max_model_len": m.max_context}
    if getattr(m, "residency", None) is not None:
        out.update(residency=m.residency, arena_gen=m.arena_gen)
    return out


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [
        _card(m) for m in request.app.state.backend.models()
    ]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str):
    for m in request.app.state.backend.models():
        if m.id == model_id:
            return _card(m)
    raise ApiError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
