"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every way a request can go wrong ends here: bad JSON (400), a field that fails validation (400,
naming the field as ``param``), an unknown model or session (404), a wrong admin key (401), a
refusal (503/429), our own bug (500, logged once). The server keeps serving everyone else.
"""
from __future__ import annotations

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from residency.control.scheduler.port import BackendError

log = structlog.get_logger("residency.api")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(BackendError):
    """An error raised by the API layer itself (same shape as the backend's)."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, type or _TYPE_BY_STATUS.get(status, "invalid_request_error"), param, code),
        status_code=status, headers=headers,
    )


def from_backend_error(e: BackendError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, headers=headers or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, e: BackendError):
        return from_backend_error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
        return error_response(400, f"{'.'.join(loc) or 'request'}: {err.get('msg', 'invalid')}",
                              param=".".join(loc) or None, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(e.status_code, str(e.detail), code=code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("api_unhandled_error", path=request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}", code="internal_error")
