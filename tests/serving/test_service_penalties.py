"""Penalties and logit_bias through the whole serving stack (tests/serving/stack.py: a tiny random
Llama, bytes as tokens, id = byte + 1, a vocabulary of 300): the worker's sampler applies them to
every choice, streamed or not, and a bias beyond the model's vocabulary is a 400 naming it."""
from __future__ import annotations

import json

import pytest

from tests.serving.stack import names, stack  # noqa: F401 - stack: the fixture


def tok(ch: str) -> int:
    return ord(ch) + 1


def completion(s, **kw):
    body = {"model": "tiny", "prompt": "abc abc abc", "max_tokens": 12, "temperature": 0, **kw}
    return s.client.post("/v1/completions", json=body)


def streamed_text(s, route: str, body: dict) -> dict[int, str]:
    texts: dict[int, str] = {}
    with s.client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


def test_a_bias_of_100_makes_greedy_pick_that_token_on_both_routes_streamed_or_not(stack):
    s = stack()
    r = s.chat("hello", max_tokens=6, logit_bias={str(tok("Z")): 100})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Z" * 6
    r = completion(s, logit_bias={tok("q"): 100}, n=2)
    assert [c["text"] for c in r.json()["choices"]] == ["q" * 12] * 2
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(tok("Y")): 100}}
    assert streamed_text(s, "/v1/chat/completions", body) == {0: "Y" * 5}


def test_a_frequency_penalty_is_counted_per_choice_over_its_own_tokens(stack):
    s = stack()
    # two tokens lifted far above the rest: which one greedy takes is then up to the penalty
    bias = {str(tok("a")): 100, str(tok("b")): 100}
    plain = completion(s, logit_bias=bias).json()["choices"][0]["text"]
    assert set(plain) <= {"a", "b"}
    one = completion(s, logit_bias=bias, frequency_penalty=2).json()["choices"][0]["text"]
    assert set(one) == {"a", "b"}, one                   # each use costs 2: the other one takes over
    assert abs(one.count("a") - one.count("b")) < 12 and one != plain
    # n = 3: every choice gets the text of one alone, so none counted another's tokens
    r = completion(s, logit_bias=bias, frequency_penalty=2, n=3)
    assert [c["text"] for c in r.json()["choices"]] == [one] * 3
    body = {"model": "tiny", "prompt": "abc abc abc", "max_tokens": 12, "temperature": 0, "logit_bias": bias,
            "frequency_penalty": 2, "n": 2}
    assert streamed_text(s, "/v1/completions", body) == {0: one, 1: one}


def test_presence_and_repetition_penalties_change_greedy_text(stack):
    s = stack()
    bias = {str(tok("a")): 100, str(tok("b")): 100}
    pres = completion(s, logit_bias=bias, presence_penalty=2).json()["choices"][0]["text"]
    assert set(pres) == {"a", "b"}, pres
    # repetition reads the prompt too: "a" and "b" are in it, so their ~100 is halved and "z" (60,
    # not in the prompt) wins the first step; once generated it is halved too, and "a"/"b" win again
    bias_c = {**bias, str(tok("z")): 60}
    rep = completion(s, logit_bias=bias_c, repetition_penalty=2).json()["choices"][0]["text"]
    assert rep[0] == "z" and set(rep[1:]) <= {"a", "b"}, rep


def test_a_bias_on_an_id_beyond_the_models_vocabulary_is_400_naming_it_and_holds_nothing(stack):
    s = stack()
    r = s.chat("hello", logit_bias={"299": 1, "300": 5, "4000": -3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["code"] == "invalid_token_id"
    assert "300" in err["message"] and "300 tokens" in err["message"], err
    assert s.chat("hello", logit_bias={"299": 1}).status_code == 200
    s.close()
    events, state = s.ledger()
    n = names(events)
    assert n.count("RequestRefused") == 1 and n.count("RequestAdmitted") == n.count("RequestFinished") == 1
    assert not state.blocks.get(0)
