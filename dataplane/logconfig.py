"""structlog for a worker process: one JSON line per event on stderr (the supervisor keeps the
worker's stderr), readable instead when stderr is a terminal; warnings and above unless
RESIDENCY_WORKER_LOG_LEVEL says otherwise. RESIDENCY_LOG_FORMAT=json|console overrides the format.
"""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_worker_logging() -> None:
    """Set up structlog once, at the start of a worker process's main()."""
    fmt = os.environ.get("RESIDENCY_LOG_FORMAT")
    as_json = fmt == "json" if fmt in ("json", "console") else not sys.stderr.isatty()
    level = (os.environ.get("RESIDENCY_WORKER_LOG_LEVEL") or "warning").upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.WARNING)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
