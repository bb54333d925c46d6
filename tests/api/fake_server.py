"""The API app on the fake backend, served the way ``residency serve`` serves it (``start_api``:
uvicorn in a thread, the serve log set-up) in a process of its own, so tests can talk raw HTTP to
it and read its stderr as an operator would read serve's log.

    python -m tests.api.fake_server PORT MAX_BODY_BYTES BODY_TIMEOUT_S
"""
from __future__ import annotations

import sys
import threading
import time

from residency.control.api import ApiConfig, create_app
from residency.control.cli.serve_api import start_api
from residency.control.logconfig import configure_logging
from tests.api.fake_backend import FakeBackend

WORDS = ["w"] * 200          # with DELAY_S, a generation long enough to leave in the middle of
DELAY_S = 0.02


def main() -> None:
    port, max_body_bytes, body_timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    configure_logging(json=True)
    app = create_app(FakeBackend(words=WORDS, delay_s=DELAY_S),
                     ApiConfig(max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s))
    server, thread = start_api(app, "127.0.0.1", port)
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    print("ready" if server.started else "failed", flush=True)
    threading.Event().wait()      # until the test kills us


if __name__ == "__main__":
    main()
