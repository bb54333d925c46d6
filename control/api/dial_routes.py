"""``POST /admin/resize``: resize a worker's device pool live (the dial, control/dialing.py).

    {"worker": 0, "tier": "device", "bytes": 6442450944}

Answered with what the ledger recorded for it (``events``, each with its seq) and its outcome:

    200 committed   the pool has its new size and every reader carries the new generation
    409 refused     below the floor, another resize running, host cannot take what must leave, or
                    the worker refused (above the card): the arithmetic is in the events; nothing changed
    503 torn        a reader missed its stamp (or the worker never answered): the pool takes no request
                    and no move until a complete resize repairs it
    502 stopped     a move out of the pool failed before the rebind (its outcome is in the events)
    400             a body that is not a resize (another tier, a size under one block, a bad field)

Admin routes need the admin key when one is configured (admin_routes).
"""
from __future__ import annotations

import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from residency.control.api.admin_routes import _authorize
from residency.control.api.errors import ApiError
from residency.control.api.schemas import parse_json, validate
from residency.events.asks import AskResize
from residency.events.codec import event_to_display_obj

router = APIRouter()
_REFUSED = ("MoveRefused", "RebindRefused")
_STOPPED = ("MoveFailed", "MoveRejected", "MoveStranded", "MoveAbandoned")


class ResizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker: StrictInt = Field(ge=0)
    tier: Literal["device", "host", "disk"] = "device"
    bytes: StrictInt = Field(gt=0)


def outcome(types: list[str]) -> tuple[str, int]:
    """The resize's outcome and HTTP status, from the types of the events recorded for it."""
    if "RebindCommitted" in types:
        return "committed", 200
    if "RebindTorn" in types:
        return "torn", 503
    if any(t in _REFUSED for t in types):
        return "refused", 409
    if any(t in _STOPPED for t in types):
        return "stopped", 502
    return "unknown", 500


@router.post("/admin/resize")
async def resize(request: Request):
    _authorize(request)
    body = validate(ResizeBody, parse_json(await request.body()))
    ask = AskResize(ask_id=f"api-{uuid.uuid4().hex[:12]}", worker=body.worker, tier=body.tier, bytes=body.bytes)
    backend = request.app.state.backend
    answer = await backend.ask_control(ask)
    if answer.error is not None:
        status = 503 if answer.error in ("shutting_down",) else 400
        raise ApiError(status, answer.detail or answer.error, code=answer.error)
    types = [type(e).__name__ for e in answer.events]
    result, status = outcome(types)
    return JSONResponse({
        "ask_id": answer.ask_id, "outcome": result, "worker": body.worker, "tier": body.tier, "bytes": body.bytes,
        "events": [dict(seq=s, **event_to_display_obj(e)) for s, e in zip(answer.seqs, answer.events)],
        "move_ids": answer.move_ids,
    }, status_code=status)


__all__ = ["router", "outcome", "ResizeBody"]
