"""``GET /admin/memory``: the memory view (control/memory.py) of every worker and tier, after a
fresh probe of each worker's counters. Admin auth as the other admin routes.

    ?probe_timeout_ms=N   how long to wait for the workers' probes (1..30000, default 1000); a
                          worker that does not answer in time is shown with its probe unknown
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from residency.control.api.admin_routes import _authorize
from residency.control.api.errors import ApiError

MAX_PROBE_MS = 30_000

router = APIRouter()


@router.get("/admin/memory")
async def memory(request: Request):
    _authorize(request)
    raw = request.query_params.get("probe_timeout_ms", "1000")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PROBE_MS:
        raise ApiError(400, f"probe_timeout_ms must be an integer in [1, {MAX_PROBE_MS}], not {raw!r}",
                       param="probe_timeout_ms", code="invalid_value")
    view = await request.app.state.backend.memory(int(raw))
    return Response(view, media_type="application/json")
