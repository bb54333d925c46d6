"""``/health``, ``/metrics`` and the admin routes that park or restore a session by hand.

Admin routes need ``Authorization: Bearer <admin key>`` when a key is configured (401 otherwise,
compared in constant time). Parking or restoring is the same write-ahead move the policy makes:
the ledger records who asked (``operator:park``).
"""
from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from residency.control.api.errors import ApiError
from residency.control.api.schemas import SESSION_ID_RE, ParkBody, parse_json, validate
from residency.control.scheduler.port import SessionInfo

MAX_LISTED = 1000           # sessions one GET /admin/sessions may list

router = APIRouter()


def session_json(info: SessionInfo) -> dict:
    return {
        "session_id": info.session, "tier": info.tier, "num_blocks": info.num_blocks, "num_tokens": info.num_tokens,
        "bytes": info.bytes, "busy": info.busy, "last_used_ns": info.last_used_ns, "move_id": info.move_id,
        "blocks_by_tier": info.blocks_by_tier, "note": info.note,
    }


def _authorize(request: Request) -> None:
    key = request.app.state.config.admin_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "admin routes need 'Authorization: Bearer <admin key>'", code="missing_admin_key")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "the admin key is wrong", code="invalid_admin_key")


def _check_session_id(session: str) -> None:
    if not SESSION_ID_RE.match(session.removeprefix("~")):     # "~...": a retained prefix's session
        raise ApiError(404, f"no session named {session!r}", param="session_id", code="session_not_found")


@router.get("/health")
async def health(request: Request):
    h = request.app.state.backend.health()
    return JSONResponse({"status": "ok" if h.ok else "unavailable", **h.detail}, status_code=200 if h.ok else 503)


@router.get("/metrics")
def metrics(request: Request):
    # sync on purpose: FastAPI runs it in its thread pool, so a scrape that waits for the control
    # loop (Backend.stats) never holds up the event loop that streams tokens
    data, content_type = request.app.state.metrics.render()
    return Response(data, media_type=content_type)


@router.get("/admin/sessions")
async def list_sessions(request: Request):
    _authorize(request)
    raw = request.query_params.get("limit", "100")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LISTED:
        raise ApiError(400, f"limit must be an integer in [1, {MAX_LISTED}], not {raw!r}", param="limit",
                       code="invalid_value")
    infos, total = await request.app.state.backend.sessions(int(raw))
    return {"object": "list", "data": [session_json(i) for i in infos], "total": total}


@router.get("/admin/sessions/{session}")
async def get_session(request: Request, session: str):
    _authorize(request)
    _check_session_id(session)
    return session_json(await request.app.state.backend.session(session))


@router.delete("/admin/sessions/{session}")
async def delete_session(request: Request, session: str):
    _authorize(request)
    _check_session_id(session)
    info, freed = await request.app.state.backend.delete(session)
    return {**session_json(info), "deleted": True, "bytes_freed": freed}


@router.post("/admin/sessions/{session}/park")
async def park_session(request: Request, session: str):
    _authorize(request)
    _check_session_id(session)
    raw = await request.body()
    body = validate(ParkBody, parse_json(raw)) if raw.strip() else ParkBody()
    return session_json(await request.app.state.backend.park(session, body.tier))


@router.post("/admin/sessions/{session}/restore")
async def restore_session(request: Request, session: str):
    _authorize(request)
    _check_session_id(session)
    return session_json(await request.app.state.backend.restore(session))
