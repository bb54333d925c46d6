"""The API tests' fake-backend app (fixtures ``backend``, ``client``, ``oai``) and their helpers."""
from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from residency.control.api import ApiConfig, create_app
from tests.api.fake_backend import MODEL, FakeBackend

ADMIN_KEY = "s3cret"


@pytest.fixture()
def backend():
    return FakeBackend()


@pytest.fixture()
def client(backend):
    with TestClient(create_app(backend, ApiConfig(admin_key=ADMIN_KEY))) as c:
        yield c


@pytest.fixture()
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def _chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}
    body.update(kw)
    return body


def assert_openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err
