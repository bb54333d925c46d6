"""The control's logging set-up writes to the stderr of the moment, not the one it was set up with."""
import io
import json
import sys

import structlog

from residency.control import logconfig


def test_a_log_line_after_stderr_was_replaced_and_closed_goes_to_the_new_stderr(monkeypatch):
    saved = structlog.get_config()
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(logconfig, "_configured", False)
    monkeypatch.setattr(sys, "stderr", first)
    try:
        logconfig.configure_logging(json=True)
        log = structlog.get_logger("test.logconfig")
        log.info("before_close", n=1)
        first.close()                       # what pytest does to a test's captured stream
        monkeypatch.setattr(sys, "stderr", second)
        log.info("after_close", n=2)        # raised ValueError (I/O on closed file) before the fix
    finally:
        structlog.configure(**saved)
    (line,) = second.getvalue().splitlines()
    assert json.loads(line)["event"] == "after_close"
