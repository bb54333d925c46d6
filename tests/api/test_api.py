"""The HTTP API against a fake backend: wire format, validation, errors, auth, metrics.

Only the edge is faked; tests/serving runs the real server with the real model.
"""
from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from residency.control.api import ApiConfig, create_app
from tests.api.conftest import ADMIN_KEY, _chat, assert_openai_error
from tests.api.fake_backend import MODEL, FakeBackend

# ------------------------------------------------------------------ happy paths, via the official client
def test_the_openai_client_reads_a_chat_completion_with_usage(oai, backend):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                    temperature=0, seed=7, extra_body={"session_id": "s1"})
    assert r.choices[0].message.content == "Hello, world!"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model_extra["session_id"] == "s1"
    req = backend.submitted[-1]
    assert (req.session, req.sampling.temperature, req.sampling.seed, req.sampling.max_tokens) == ("s1", 0.0, 7, 10)


def test_the_openai_client_streams_a_chat_completion(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


def test_completions_stream_and_not(oai):
    r = oai.completions.create(model=MODEL, prompt="once upon", max_tokens=2)
    assert r.choices[0].text == "Hello,"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 2
    text = "".join(c.choices[0].text for c in oai.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True))
    assert text == "Hello, world!"


def test_models_lists_the_served_model(oai, client):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/nope"), 404, code="model_not_found")


def test_the_session_can_come_from_a_header(client, backend):
    r = client.post("/v1/chat/completions", json=_chat(), headers={"X-Session-Id": "hdr-1"})
    assert r.status_code == 200 and backend.submitted[-1].session == "hdr-1"
    assert r.headers["x-session-id"] == "hdr-1"
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(session_id="a"), headers={"X-Session-Id": "b"}),
                        400, param="session_id")


def test_stop_strings_reach_the_backend(client, backend):
    r = client.post("/v1/chat/completions", json=_chat(stop="!"))
    assert r.status_code == 200 and backend.submitted[-1].sampling.stop == ["!"]
    assert r.json()["choices"][0]["message"]["content"] == "Hello, world"


def test_ignore_eos_reaches_the_backend_and_must_be_a_bool(client, backend):
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200
    assert backend.submitted[-1].sampling.ignore_eos is False
    assert client.post("/v1/chat/completions", json=_chat(ignore_eos=True)).status_code == 200
    assert backend.submitted[-1].sampling.ignore_eos is True
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(ignore_eos="yes")), 400, param="ignore_eos")


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_invalid_json_is_400(client, raw):
    assert_openai_error(client.post("/v1/chat/completions", content=raw,
                                    headers={"content-type": "application/json"}), 400, code="invalid_json")


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "messages"),
    (_chat(messages=[]), "messages"),
    (_chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (_chat(messages=[{"role": "user"}]), "messages"),
    (_chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": "x"}]), "messages"),
    (_chat(max_tokens=-1), "max_tokens"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_tokens=10**40), "max_tokens"),
    (_chat(max_tokens="many"), "max_tokens"),
    (_chat(temperature=-0.1), "temperature"),
    (_chat(top_p=0), "top_p"),
    (_chat(n=9), "n"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_chat(session_id="bad id with spaces"), "session_id"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_invalid_fields_are_400_naming_the_param(client, backend, body, param):
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param=param)
    assert backend.submitted == []


_CMPL = {"model": MODEL, "prompt": "x"}


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("/v1/chat/completions", _chat(tool_choice="auto"), "tool_choice"),
    ("/v1/chat/completions", _chat(functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object"}), "response_format"),
    ("/v1/chat/completions", _chat(modalities=["text", "audio"]), "modalities"),
    ("/v1/chat/completions", _chat(store=True), "store"),
    ("/v1/chat/completions", _chat(reasoning_effort="high"), "reasoning_effort"),
    ("/v1/chat/completions", _chat(top_k=5), "top_k"),
    ("/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True, "every_n": 2}),
     "stream_options"),
    ("/v1/completions", {**_CMPL, "suffix": "the end"}, "suffix"),
    ("/v1/completions", {**_CMPL, "tools": []}, "tools"),       # a chat option, unknown to completions
])
def test_a_field_the_server_does_not_act_on_is_400_naming_it(client, backend, route, body, param):
    err = assert_openai_error(client.post(route, json=body), 400, param=param)
    assert param in err["message"]
    assert backend.submitted == []


@pytest.mark.parametrize("extra,said", [
    ({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool calls"),
    ({"audio": {"id": "a1"}}, "audio"),
    ({"refusal": "no"}, "refusal"),
])
def test_a_message_key_the_template_would_drop_is_400_naming_it(client, backend, extra, said):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", **extra}]
    err = assert_openai_error(client.post("/v1/chat/completions", json=_chat(messages=msgs)), 400, param="messages")
    assert said in err["message"] and "messages.1" in err["message"], err
    assert backend.submitted == []


def test_message_labels_are_accepted(client, backend):
    msgs = [{"role": "user", "content": "x", "name": "ann"}, {"role": "assistant", "content": "y", "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": "z"}]
    assert client.post("/v1/chat/completions", json=_chat(messages=msgs)).status_code == 200


def test_every_unknown_field_is_named_at_once(client, backend):
    err = assert_openai_error(client.post("/v1/chat/completions", json=_chat(min_p=0.1, top_k=3)), 400,
                              code="unsupported_parameter", param="min_p")
    assert "'min_p', 'top_k'" in err["message"]


def test_what_common_clients_send_by_default_is_served(client, backend, oai):
    """Chat front-ends send the neutral value of options they never set, and labels like ``user``:
    those ask for nothing this server does not do, so they are accepted."""
    body = _chat(user="u-1", presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=[], tool_choice="none",
                 parallel_tool_calls=True, response_format={"type": "text"}, n=1, store=False, metadata={"k": "v"},
                 modalities=["text"], stream_options={"include_usage": False})
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    r = client.post("/v1/completions", json={**_CMPL, "user": "u-1", "presence_penalty": 0, "suffix": None,
                                            "logit_bias": None, "best_of": 1, "echo": False})
    assert r.status_code == 200, r.text
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], user="u-2",
                                    presence_penalty=0, frequency_penalty=0, response_format={"type": "text"})
    assert r.choices[0].message.content == "Hello, world!"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    assert len(backend.submitted) == 3
    assert all(r.sampling.presence_penalty == r.sampling.frequency_penalty == 0.0 and r.sampling.logit_bias == {}
               and r.sampling.repetition_penalty == 1.0 for r in backend.submitted)


def test_penalties_and_logit_bias_reach_the_backend_from_both_routes(client, backend, oai):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], presence_penalty=0.6,
                                frequency_penalty=-1.25, logit_bias={"42": 5, "7": -100},
                                extra_body={"repetition_penalty": 1.15})
    r = client.post("/v1/completions", json={**_CMPL, "frequency_penalty": 2, "logit_bias": {"0": 100}, "n": 2,
                                            "repetition_penalty": 0.9})
    assert r.status_code == 200, r.text
    chat, *choices = backend.submitted
    s = chat.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias) == (0.6, -1.25, 1.15,
                                                                                             {42: 5.0, 7: -100.0})
    assert len(choices) == 2        # n = 2: each choice is its own sequence, with the same penalties
    for c in choices:
        s = c.sampling
        assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias) == (0.0, 2.0, 0.9,
                                                                                                 {0: 100.0})


@pytest.mark.parametrize("field,value,said", [
    ("presence_penalty", 2.5, "less than or equal to 2"),
    ("presence_penalty", "Infinity", None),
    ("frequency_penalty", -2.01, "greater than or equal to -2"),
    ("frequency_penalty", "lots", None),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", -1.5, "greater than 0"),
    ("logit_bias", {"42": 101}, "token 42"),
    ("logit_bias", {"42": -100.5}, "token 42"),
    ("logit_bias", {"42": "high"}, "token 42"),
    ("logit_bias", {"42": True}, "token 42"),
    ("logit_bias", {"hello": 1}, "'hello'"),
    ("logit_bias", {"-3": 1}, "'-3'"),
    ("logit_bias", {"4.0": 1}, "'4.0'"),
    ("logit_bias", {"99999999999": 1}, "99999999999"),
    ("logit_bias", {"4": 1, "04": 1}, "token id 4 is named twice"),
    ("logit_bias", {str(i): 1 for i in range(1025)}, "at most 1024"),
    ("logit_bias", [1, 2], "object"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_penalty_or_bias_out_of_range_is_400_naming_it(client, backend, route, field, value, said):
    body = _chat() if route == "/v1/chat/completions" else dict(_CMPL)
    raw = f'{{"model": "{MODEL}", "{field}": {json.dumps(value) if value != "Infinity" else "Infinity"}, ' + \
          (f'"messages": {json.dumps(body["messages"])}}}' if "messages" in body else '"prompt": "x"}')
    r = client.post(route, content=raw.encode(), headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, code="invalid_value", param=field)
    assert field in err["message"] and (said is None or said in err["message"]), err
    assert backend.submitted == []


@pytest.mark.parametrize("route,raw,param", [
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", '
                             b'"text": "\\udfff"}]}]}', "messages"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "stop": ["\\ud83d"]}',
     "stop"),
    ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_anywhere_in_the_text_is_a_400_naming_where(client, backend, route, raw, param):
    """JSON may spell a lone surrogate with an escape; it decodes to a str that cannot be encoded for
    the worker (the request then hung, unanswered). It is refused before it reaches the backend."""
    err = assert_openai_error(client.post(route, content=raw % MODEL.encode(),
                                          headers={"content-type": "application/json"}), 400, param=param)
    assert "surrogate" in err["message"]
    assert backend.submitted == []


@pytest.mark.parametrize("ids", [[1, 2**64], [2**31], [-1]])
def test_completion_token_ids_out_of_any_vocabulary_are_400(client, backend, ids):
    assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": ids}), 400, param="prompt")
    assert backend.submitted == []


def test_only_an_assistant_message_may_come_without_content(client, backend):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]
    assert client.post("/v1/chat/completions", json=_chat(messages=msgs)).status_code == 200
    r = client.post("/v1/chat/completions", json=_chat(messages=[{"role": "tool"}]))
    assert_openai_error(r, 400, param="messages")
    assert "a tool message needs content" in r.json()["error"]["message"]


def test_content_parts_other_than_text_are_refused_by_their_type(client, backend):
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    assert client.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": parts}])).status_code == 200
    assert backend.submitted[-1].messages[-1].content == "Hi there"
    for content, said in (([parts[0], {"type": "image_url", "image_url": {"url": "http://x"}}],
                           "content part 1 is of type 'image_url'"),
                          (["plain"], "content part 0 is of type 'str'"),
                          (42, "content must be a string or a list of text parts, not int")):
        r = client.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": content}]))
        assert_openai_error(r, 400, param="messages")
        assert said in r.json()["error"]["message"], r.json()


def test_an_unknown_model_is_404(client):
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(model="gpt-9")), 404,
                        code="model_not_found", param="model")


def test_a_prompt_longer_than_the_context_is_400_from_the_backend(client):
    long = " ".join(["word"] * 100)
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": long}])),
                        400, code="context_length_exceeded")
    assert_openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000}),
                        400, code="context_length_exceeded")


def test_the_openai_client_raises_its_own_error_types(oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_an_unknown_route_is_an_openai_shaped_404(client):
    assert_openai_error(client.get("/v1/nothing"), 404)


# ------------------------------------------------------------------ admin
def test_admin_routes_need_the_key(client, backend):
    assert_openai_error(client.post("/admin/sessions/known/park"), 401, code="missing_admin_key")
    assert_openai_error(client.post("/admin/sessions/known/park", headers={"Authorization": "Bearer nope"}), 401,
                        code="invalid_admin_key")
    assert backend.tiers["known"] == "device"
    r = client.post("/admin/sessions/known/park", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    json={"tier": "disk"})
    assert r.status_code == 200 and r.json()["tier"] == "disk" and r.json()["move_id"] == "m-1"
    r = client.post("/admin/sessions/known/restore", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and r.json()["tier"] == "device"


def test_admin_on_an_unknown_session_is_404(client):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert_openai_error(client.post("/admin/sessions/ghost/park", headers=auth), 404, code="session_not_found")
    assert_openai_error(client.post("/admin/sessions/ghost/restore", headers=auth), 404, code="session_not_found")
    assert_openai_error(client.post("/admin/sessions/known/park", headers=auth, json={"tier": "moon"}), 400)


def test_admin_routes_are_open_without_a_configured_key():
    with TestClient(create_app(FakeBackend(), ApiConfig(admin_key=None))) as c:
        assert c.post("/admin/sessions/known/park").status_code == 200


# ------------------------------------------------------------------ health and metrics
def test_health_and_metrics(client, oai):
    assert client.get("/health").json()["status"] == "ok"
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
    client.post("/v1/chat/completions", content=b"{")
    text = client.get("/metrics").text
    assert 'residency_http_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
    assert 'residency_http_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
    assert "residency_time_to_first_token_seconds_count{endpoint=\"chat\"} 2.0" in text
    assert "residency_inter_token_latency_seconds_count" in text
    assert 'residency_tier_used_bytes{tier="device",worker="0"} 4096.0' in text
    assert 'residency_moves_total{kind="park",outcome="MoveAcked"} 1.0' in text
    assert "residency_stranded_bytes 0.0" in text
    assert "residency_ledger_append_lag_seconds 0.001" in text
    assert "residency_completion_tokens_total 8.0" in text


def _histogram_count(client, name: str, endpoint: str) -> float:
    needle = f'{name}_count{{endpoint="{endpoint}"}} '
    line = next((ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(needle)), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_inter_token_latency_counts_every_gap_of_every_choice_streamed_or_not(client):
    """Each of the 4 canned tokens after the first is one gap, per choice; a request answered in one
    piece has gaps between its tokens as much as a streamed one."""
    itl = "residency_inter_token_latency_seconds"
    assert client.post("/v1/chat/completions", json=_chat()).status_code == 200
    assert _histogram_count(client, itl, "chat") == 3
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2}).status_code == 200
    assert _histogram_count(client, itl, "completions") == 6
    with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True, n=2)) as r:
        assert r.status_code == 200 and list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert _histogram_count(client, itl, "chat") == 3 + 6, "gaps are per choice, not between two choices' tokens"
    assert _histogram_count(client, "residency_time_to_first_token_seconds", "chat") == 2


def test_a_stream_that_is_closed_early_cancels_its_generation():
    backend = FakeBackend(words=["w"] * 50, delay_s=0.01)
    with TestClient(create_app(backend)) as c:
        with c.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"w"' in line:
                    break
        # TestClient closes the response: the app sees http.disconnect
    assert backend.streams[-1].cancelled == "disconnected"
def test_the_admin_list_of_sessions_needs_the_key_and_a_sane_limit(client, backend):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert_openai_error(client.get("/admin/sessions"), 401, code="missing_admin_key")
    backend.tiers.update({"b": "host", "a": "disk"})
    r = client.get("/admin/sessions", headers=auth)
    assert r.status_code == 200 and r.json()["total"] == 3
    assert [s["session_id"] for s in r.json()["data"]] == ["a", "b", "known"]
    r = client.get("/admin/sessions?limit=2", headers=auth)
    assert [s["session_id"] for s in r.json()["data"]] == ["a", "b"] and r.json()["total"] == 3
    for bad in ("0", "1001", "x", "-1"):
        assert_openai_error(client.get(f"/admin/sessions?limit={bad}", headers=auth), 400, param="limit")


def test_deleting_a_session_needs_the_key_and_names_what_it_freed(client, backend):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert_openai_error(client.delete("/admin/sessions/known"), 401, code="missing_admin_key")
    r = client.delete("/admin/sessions/known", headers=auth)
    assert r.status_code == 200 and r.json()["deleted"] is True and r.json()["bytes_freed"] == 2048
    assert "known" not in backend.tiers
    assert_openai_error(client.delete("/admin/sessions/known", headers=auth), 404, code="session_not_found")
