"""structlog for the control process and the operator commands: JSON lines in production,
readable in a terminal. (A worker process sets up its own: dataplane/logconfig.py.)
"""
from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class StderrNow:
    """Writes to whatever ``sys.stderr`` is at the moment of the write.

    NOTE: structlog's PrintLogger keeps the file it was given. Given ``sys.stderr`` at set-up, a
    process whose stderr is later replaced (pytest's capture, closed after the test that set it up)
    would write every later line to a closed stream and raise from inside a log call.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


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
        logger_factory=structlog.PrintLoggerFactory(file=StderrNow()),
        cache_logger_on_first_use=True,
    )
    _configured = True
