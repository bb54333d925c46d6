"""``create_app(backend, config)``: the HTTP face of Residency.

    client ─HTTP─► app (validation, SSE, metrics) ─► Backend.submit ─► control process
                                                                     (admit, place, run, record)
"""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from residency.control.api import admin_routes, dial_routes, flip_routes, memory_routes, openai_routes, tenant_routes
from residency.control.api.body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BoundedBody
from residency.control.api.errors import install_error_handlers
from residency.control.api.metrics import ApiMetrics
from residency.control.scheduler.port import Backend


@dataclass(frozen=True)
class ApiConfig:
    admin_key: str | None = None          # None: admin routes are open (the server binds to loopback)
    title: str = "Residency"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES    # a larger request body is answered 413
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body not whole by then is answered 408

    def __post_init__(self):
        # checked here, not in the middleware: Starlette builds that only at the first request
        if self.max_body_bytes < 1 or not 0 < self.body_timeout_s < float("inf"):
            raise ValueError(f"a request body needs a limit of at least 1 byte and a finite timeout above 0 s, "
                             f"got {self.max_body_bytes} bytes and {self.body_timeout_s} s")


class _CountRequests:
    """Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from streaming routes)."""

    def __init__(self, app, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", None) or "unmatched", str(status)).inc()


def create_app(backend: Backend, config: ApiConfig | None = None) -> FastAPI:
    config = config or ApiConfig()
    app = FastAPI(title=config.title, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.config = config
    app.state.metrics = ApiMetrics(backend)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(memory_routes.router)
    app.include_router(dial_routes.router)
    app.include_router(flip_routes.router)
    app.include_router(tenant_routes.router)

    # the last added runs first: every answer, a refused body's too, is counted
    app.add_middleware(BoundedBody, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(_CountRequests, metrics=app.state.metrics)
    return app
