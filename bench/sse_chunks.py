"""The chunks of an OpenAI-style event stream: ``data: {...}`` lines closed by ``data: [DONE]``.
Both load generators (e2e_users.py, soak_clients.py) read a stream this one way."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator


class SseChunks:
    """Iterates the JSON chunks of ``lines`` up to ``data: [DONE]``; other lines (blank keep-alives,
    comments) are passed over. ``done`` turns True when ``[DONE]`` arrives: still False after the
    iteration ends, the stream was cut short."""

    def __init__(self, lines: Iterable[str]):
        self.lines = lines
        self.done = False

    def __iter__(self) -> Iterator[dict]:
        for line in self.lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                self.done = True
                return
            yield json.loads(line[6:])
