"""``POST /admin/reclaim`` and ``POST /admin/release``: an outside tenant (declared with
``serve --tenant``) takes device memory from the server and gives it back.

Both are asks to the control process (``AskReclaim``/``AskReleaseTenant``), answered once what
they recorded is committed. The answer is what the ledger recorded:

    200  TenantReclaimed / TenantReleased: the bytes granted, those the moves freed, and what the
         driver measured (null: not measured, never a guess). A tensor-parallel group records one
         per rank: the answer sums them (measured: null unless every rank was measured) and lists
         each under ``ranks``
    400  an unknown tenant (the declared ones named), bytes <= 0, a worker that does not serve
    409  refused whole (MoveRefused with asked, available, floor and the sum); nothing moved.
         Or a reclaim/resize already under way.
    503  TenantReclaimFailed: a move it needed failed or stranded (the stranded bytes named), or
         the dial refused; nothing was granted
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from residency.control.api.admin_routes import _authorize
from residency.control.api.errors import error_body
from residency.control.api.schemas import parse_json, validate
from residency.events import catalog as ev
from residency.events.asks import AskAnswered, AskReclaim, AskReleaseTenant

router = APIRouter()
_ids = iter(range(1, 1 << 62))


class ReclaimBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: StrictStr
    bytes: StrictInt
    worker: StrictInt = 0


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: StrictStr
    worker: StrictInt = 0


def answer_json(ans: AskAnswered) -> tuple[int, dict]:
    """The HTTP status and body of a reclaim's or release's answer."""
    if ans.error is not None:
        busy = ans.detail.startswith("busy:")
        return (409 if busy else 400), error_body(ans.detail or ans.error,
                                                  "conflict_error" if busy else "invalid_request_error",
                                                  code="reclaim_busy" if busy else ans.error)
    moves = [{"seq": s, "type": type(e).__name__, "move_id": getattr(e, "move_id", None)}
             for s, e in zip(ans.seqs, ans.events) if type(e) not in _FINAL]
    final = next(((s, e) for s, e in zip(ans.seqs, ans.events) if type(e) in _FINAL), None)
    if final is None:
        return 500, error_body("the ask was answered without an outcome", "server_error", code="no_outcome")
    seq, e = final
    t = type(e)
    if t is ev.MoveRefused:
        body = error_body(f"refused: {e.reason}", "conflict_error", code="reclaim_refused")
        body["refusal"] = {"seq": seq, "ask": e.ask, "worker": e.worker, "tier": e.tier, "asked_bytes": e.asked_bytes,
                           "available_bytes": e.available_bytes, "floor_bytes": e.floor_bytes, "reason": e.reason}
        return 409, body
    if t is ev.TenantReclaimFailed:
        body = error_body(f"the reclaim failed: {e.reason}", "server_error", code="reclaim_failed")
        body["failure"] = {"seq": seq, "tenant": e.tenant, "worker": e.worker, "asked_bytes": e.asked_bytes,
                           "moves": e.moves, "stranded_bytes": e.stranded_bytes, "stranded_moves": e.stranded_moves,
                           "outcomes": moves}
        return 503, body
    ranks = [(s, r) for s, r in zip(ans.seqs, ans.events) if type(r) is t]    # a group: one per rank, leader first
    measured = [r.measured_bytes for _, r in ranks]
    group = {"measured_bytes": None if None in measured else sum(measured), "rebind_id": e.rebind_id}
    if t is ev.TenantReclaimed:
        return 200, {"object": "tenant.reclaim", "seq": seq, "tenant": e.tenant, "worker": e.worker,
                     "asked_bytes": e.asked_bytes, "granted_bytes": sum(r.granted_bytes for _, r in ranks),
                     "freed_bytes": sum(r.freed_bytes for _, r in ranks), **group,
                     "moves": [m for _, r in ranks for m in r.moves], "sessions": e.sessions, "outcomes": moves,
                     "ranks": [{"seq": s, "worker": r.worker, "granted_bytes": r.granted_bytes,
                                "freed_bytes": r.freed_bytes, "measured_bytes": r.measured_bytes,
                                "rebind_id": r.rebind_id} for s, r in ranks]}
    return 200, {"object": "tenant.release", "seq": seq, "tenant": e.tenant, "worker": e.worker,
                 "bytes": sum(r.bytes for _, r in ranks), **group,
                 "ranks": [{"seq": s, "worker": r.worker, "bytes": r.bytes, "measured_bytes": r.measured_bytes,
                            "rebind_id": r.rebind_id} for s, r in ranks]}


_FINAL = (ev.TenantReclaimed, ev.TenantReclaimFailed, ev.TenantReleased, ev.MoveRefused)


async def _ask(request: Request, msg) -> JSONResponse:
    status, body = answer_json(await request.app.state.backend.ask_control(msg))
    return JSONResponse(body, status_code=status)


@router.post("/admin/reclaim")
async def reclaim(request: Request):
    _authorize(request)
    body = validate(ReclaimBody, parse_json(await request.body()))
    return await _ask(request, AskReclaim(ask_id=f"api-reclaim-{next(_ids)}", tenant=body.tenant,
                                          worker=body.worker, bytes=body.bytes))


@router.post("/admin/release")
async def release(request: Request):
    _authorize(request)
    body = validate(ReleaseBody, parse_json(await request.body()))
    return await _ask(request, AskReleaseTenant(ask_id=f"api-release-{next(_ids)}", tenant=body.tenant,
                                                worker=body.worker))
