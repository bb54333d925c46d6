"""A request its worker could not finish (lost, wedged) is the server's state, not the client's
fault and not our bug: 503 with Retry-After, the code naming why."""
from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

from residency.control.api import ApiConfig, create_app
from residency.control.scheduler.port import BackendError, Chunk, Usage
from tests.api.fake_backend import MODEL, FakeBackend


class _EndsInError:
    def __init__(self, req, chunk: Chunk):
        self.request_id, self.model, self.chunk = req.request_id, req.model, chunk

    def cancel(self, reason: str) -> None:
        pass

    async def __aiter__(self):
        yield Chunk(text="Hel", token_ids=[1])
        yield self.chunk


class _Backend(FakeBackend):
    def __init__(self, chunk: Chunk | None = None, refusal: BackendError | None = None):
        super().__init__()
        self.chunk, self.refusal = chunk, refusal

    async def submit(self, req):
        if self.refusal is not None:
            raise self.refusal
        return _EndsInError(req, self.chunk)


def _body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("code", ["worker_lost", "worker_wedged"])
def test_a_generation_its_worker_could_not_finish_is_a_503_to_retry(code):
    after = random.randrange(1, 30)
    chunk = Chunk(text="", finish_reason="error", error=f"worker {random.randrange(8)} went away", status=503,
                  code=code, retry_after_s=after, usage=Usage(prompt_tokens=3, completion_tokens=1))
    with TestClient(create_app(_Backend(chunk), ApiConfig())) as c:
        r = c.post("/v1/chat/completions", json=_body())
        assert r.status_code == 503 and r.headers["retry-after"] == str(after)
        assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "server_error"
        with c.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as s:
            lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert json.loads(lines[-2])["error"]["code"] == code and lines[-1] == "[DONE]"


def test_a_failed_step_is_still_a_500():
    chunk = Chunk(text="", finish_reason="error", error="RuntimeError: boom", usage=Usage(prompt_tokens=3,
                                                                                           completion_tokens=0))
    with TestClient(create_app(_Backend(chunk), ApiConfig())) as c:
        r = c.post("/v1/chat/completions", json=_body())
    assert r.status_code == 500 and "retry-after" not in r.headers
    assert r.json()["error"]["code"] == "generation_failed"


def test_a_refusal_that_says_when_to_retry_carries_retry_after():
    refusal = BackendError(503, "worker 0 makes no progress", type="server_error", code="worker_wedged",
                           retry_after_s=1)
    with TestClient(create_app(_Backend(refusal=refusal), ApiConfig())) as c:
        r = c.post("/v1/chat/completions", json=_body())
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "worker_wedged"
