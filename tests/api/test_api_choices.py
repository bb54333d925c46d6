"""The HTTP API against a fake backend: log-probabilities and n choices (wire format, streaming,
validation). The fixtures and helpers are in conftest.py."""
from __future__ import annotations

import pytest

from residency.control.scheduler.port import BackendError
from tests.api.conftest import _chat, assert_openai_error
from tests.api.fake_backend import MODEL


# ------------------------------------------------------------------ logprobs
def test_chat_logprobs_list_each_token_with_its_bytes_and_alternatives(client, backend):
    r = client.post("/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=2))
    assert r.status_code == 200 and backend.submitted[-1].sampling.logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", ",", " world", "!"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5, -0.75, -1.0]
    assert content[2]["bytes"] == list(b" world")
    assert content[0]["top_logprobs"] == [{"token": "alt0", "logprob": -1.0, "bytes": list(b"alt0")},
                                          {"token": "alt1", "logprob": -2.0, "bytes": list(b"alt1")}]
    r = client.post("/v1/chat/completions", json=_chat(logprobs=True))
    assert backend.submitted[-1].sampling.logprobs == 0
    assert all(c["top_logprobs"] == [] for c in r.json()["choices"][0]["logprobs"]["content"])
    r = client.post("/v1/chat/completions", json=_chat())
    assert backend.submitted[-1].sampling.logprobs is None and r.json()["choices"][0]["logprobs"] is None


def test_streamed_chat_chunks_carry_their_tokens_logprobs(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                              logprobs=True, top_logprobs=1))
    got = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
           for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert got == [("Hello", -0.25, ["alt0"]), (",", -0.5, ["alt0"]), (" world", -0.75, ["alt0"]), ("!", -1.0, ["alt0"])]


def test_completion_logprobs_are_parallel_lists_with_offsets_streamed_or_not(client, oai):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["Hello", ",", " world", "!"], "token_logprobs": [-0.25, -0.5, -0.75, -1.0],
                  "top_logprobs": [{"alt0": -1.0}] * 4, "text_offset": [0, 5, 6, 12]}
    parts = [c.choices[0].logprobs for c in oai.completions.create(model=MODEL, prompt="x", logprobs=0, stream=True)
             if c.choices and c.choices[0].logprobs]
    assert [o for p in parts for o in p.text_offset] == [0, 5, 6, 12]
    assert [t for p in parts for t in p.top_logprobs] == [{}, {}, {}, {}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", _chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=False, top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=1), "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
])
def test_bad_logprobs_asks_are_400_naming_the_field(client, backend, path, body, param):
    assert_openai_error(client.post(path, json=body), 400, param=param)
    assert backend.submitted == []


def test_a_logprob_that_is_not_finite_is_reported_as_minus_9999_so_the_json_stays_valid():
    from residency.control.api.logprobs import CompletionLogprobs, chat_logprobs
    from residency.events.commands import TokenChoice, TokenLogprobs
    t = TokenLogprobs(chosen=TokenChoice(token_id=1, text="a", token_bytes=b"a", logprob=float("nan")),
                      top=[TokenChoice(token_id=2, text="b", token_bytes=b"b", logprob=float("-inf"))])
    c = chat_logprobs([t])["content"][0]
    assert (c["logprob"], c["top_logprobs"][0]["logprob"]) == (-9999.0, -9999.0)
    assert CompletionLogprobs().render([t])["top_logprobs"] == [{"b": -9999.0}]


# ------------------------------------------------------------------ n choices
def test_n_choices_are_separate_generations_with_seeds_apart_and_usage_summed(client, backend):
    r = client.post("/v1/chat/completions", json=_chat(n=3, seed=41, max_tokens=10))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello, world!" for c in body["choices"])
    subs = backend.submitted[-3:]
    assert [s.request_id for s in subs] == [body["id"], f"{body['id']}-1", f"{body['id']}-2"]
    assert [s.sampling.seed for s in subs] == [41, 42, 43]
    u = body["usage"]
    assert u["completion_tokens"] == 12 and u["total_tokens"] == u["prompt_tokens"] + 12
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2, "logprobs": 0})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(c["logprobs"]["text_offset"] == [0, 5, 6, 12] for c in r.json()["choices"])


def test_streamed_choices_interleave_by_index_and_end_with_one_usage(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                              stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: "Hello, world!", 1: "Hello, world!"}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [8]


def test_n_over_one_cannot_continue_a_session_and_a_refused_choice_cancels_the_rest(client, backend, monkeypatch):
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(n=2, session_id="s")), 400, param="n")
    submit = backend.submit

    async def refuse_the_second(req):
        if req.request_id.endswith("-1"):
            raise BackendError(503, "no room for this one", type="server_error", code="insufficient_kv_capacity")
        return await submit(req)

    monkeypatch.setattr(backend, "submit", refuse_the_second)
    assert_openai_error(client.post("/v1/chat/completions", json=_chat(n=2)), 503, code="insufficient_kv_capacity")
    assert backend.streams[-1].cancelled == "a sibling choice was refused"
