"""Sleep, wake and flips of the weights arena (control/flipping.py), over HTTP.

The routes RL frameworks already call on vLLM between rollouts and training steps:

    POST /sleep?level=1|2   level 1: weights to pinned host; 2: dropped (reloaded from the file on
                            wake). The workers' requests end first and their sessions' device
                            pages are parked. Requests that arrive asleep wait, then get 503.
    POST /wake_up           the weights come back; requests flow again
    GET  /is_sleeping       {"is_sleeping": bool}

and the operator's flip between the models a server was started with:

    POST /admin/flip        {"to": "NAME", "worker": 0}   (worker optional)

Each is answered with what the ledger recorded for it (``events``, each with its seq) and its
outcome:

    200 completed   FlipCompleted, every reader of the arena at the new generation
    409 refused     a flip already runs, sleep while asleep, wake while awake, a flip to the
                    model resident, requests that did not end, a park that failed, or the worker
                    refused it (its error verbatim): nothing changed
    503 stranded    the worker died or missed the deadline: its arena serves nothing until a
                    complete flip or wake repairs it
    404             a model the server was not started with (the list is in the message)

A sleep also shrinks each worker's device KV pool to one block through the dial, and the wake
grows it back: ``kv_pool`` lists each resize (bytes, measured freed bytes) or why the pool was not
resized (the dial's refusal, with its arithmetic: the sleep completes all the same), and
``measured_freed_bytes`` sums what the driver saw freed, weights and pool (None: not measured).
    400             a bad level, worker or body

They need the admin key when one is configured (admin_routes).
"""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from residency.control.api.admin_routes import _authorize
from residency.control.api.errors import ApiError
from residency.control import flip
from residency.control.api.schemas import parse_json, validate
from residency.events.asks import AskFlip
from residency.events.codec import event_to_display_obj

router = APIRouter()


class FlipBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: StrictStr = Field(min_length=1)
    worker: StrictInt | None = Field(default=None, ge=0)


def outcome(types: list[str], stranded: bool) -> tuple[str, int]:
    """The flip's outcome and HTTP status, from the types of the events recorded for it (a sleep
    or wake of several workers: the worst of them)."""
    if stranded:
        return "stranded", 503
    if "FlipFailed" in types or "MoveRefused" in types:
        return "refused", 409
    if "FlipCompleted" in types:
        return "completed", 200
    return "unknown", 500


async def _ask(request: Request, ask: AskFlip) -> JSONResponse:
    answer = await request.app.state.backend.ask_control(ask)
    if answer.error is not None:
        detail = answer.detail or answer.error
        if detail.startswith("model_not_found"):
            raise ApiError(404, detail.partition(": ")[2] or detail, param="to", code="model_not_found")
        status = 503 if answer.error == "shutting_down" else 400
        raise ApiError(status, detail, code=answer.error)
    # the dial's refusal of the sleep's pool resize is no refusal of the sleep (kv_pool says it)
    types = [type(e).__name__ for e in answer.events if not flip.is_pool_refusal(e)]
    stranded = any(type(e).__name__ == "FlipFailed" and e.stranded for e in answer.events)
    result, status = outcome(types, stranded)
    events = [dict(seq=s, **event_to_display_obj(e)) for s, e in zip(answer.seqs, answer.events)]
    body = {"ask_id": answer.ask_id, "action": ask.action, "outcome": result, "events": events}
    if ask.action == "flip":
        body["to"] = ask.to_model
    else:       # the device KV pool the sleep shrank (or could not) and the wake grew back
        body["kv_pool"] = flip.kv_pool_outcome(answer.events)
        body["measured_freed_bytes"] = flip.freed_bytes(answer.events)
    if status != 200:
        bad = next((d for d, e in zip(events, answer.events) if d["type"] in ("FlipFailed", "MoveRefused")
                    and not flip.is_pool_refusal(e)), None)
        if bad is None:
            why, code = result, result
        elif bad["type"] == "MoveRefused":      # "code: reason"
            why, code = bad["reason"], bad["reason"].partition(":")[0]
        else:                                   # the worker's error verbatim
            why, code = bad["error"], "flip_stranded" if status == 503 else "flip_failed"
        body["error"] = {"message": why, "type": "conflict_error" if status == 409 else "server_error",
                         "param": None, "code": code}
    return JSONResponse(body, status_code=status)


@router.post("/sleep")
async def sleep(request: Request, level: str = "1"):
    _authorize(request)
    if level not in ("1", "2"):
        raise ApiError(400, f"level must be 1 (weights to host) or 2 (weights dropped), not {level!r}",
                       param="level", code="invalid_value")
    return await _ask(request, AskFlip(ask_id=f"api-{uuid.uuid4().hex[:12]}", action="sleep", level=int(level)))


@router.post("/wake_up")
async def wake_up(request: Request):
    _authorize(request)
    return await _ask(request, AskFlip(ask_id=f"api-{uuid.uuid4().hex[:12]}", action="wake"))


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    backend = request.app.state.backend
    sleeping = getattr(backend, "sleeping", None)
    return {"is_sleeping": bool(sleeping()) if sleeping is not None else False}


@router.post("/admin/flip")
async def admin_flip(request: Request):
    _authorize(request)
    body = validate(FlipBody, parse_json(await request.body()))
    return await _ask(request, AskFlip(ask_id=f"api-{uuid.uuid4().hex[:12]}", action="flip", to_model=body.to,
                                       worker=body.worker))


__all__ = ["router", "outcome", "FlipBody"]
