"""structlog, configured once per process: JSON lines in production, readable in a terminal.

Lives in events/ because every process (control, api, workers) calls it and events/ is the one
package all of them may import; it imports nothing of ours.
"""
from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(json: bool | None = None, level: str | None = None) -> None:
    """Set up structlog for this process. ``json=None`` picks JSON unless stderr is a terminal.

    RESIDENCY_LOG_FORMAT=json|console and RESIDENCY_LOG_LEVEL override the arguments.
    """
    global _configured
    if _configured:
        return
    fmt = os.environ.get("RESIDENCY_LOG_FORMAT")
    if fmt in ("json", "console"):
        json = fmt == "json"
    if json is None:
        json = not sys.stderr.isatty()
    level_name = (os.environ.get("RESIDENCY_LOG_LEVEL") or level or "info").upper()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True
