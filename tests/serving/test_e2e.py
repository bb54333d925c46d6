"""The official ``openai`` client against real ``residency serve`` processes with the real SmolLM2.

Two servers start together (each loads the model once):
  quiet    no policies: nothing moves unless asked, so one session can be the conversation that
           never moved a byte while another is parked, demoted to disk and restored between turns;
  parking  idle sessions are parked after 1 s; a 1024-token context; the bad-input cases.
Each module ends by stopping its server and replaying its ledger from zero.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.serving.server import MODEL, Server, read_ledger

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    quiet = Server(tmp, "--no-policies", name="quiet")
    parking = Server(tmp, "--park-after-s", "1", "--max-context", "1024", name="parking")
    try:
        quiet.wait_ready()
        parking.wait_ready()
        yield {"quiet": quiet, "parking": parking}
    finally:
        for s in (quiet, parking):
            s.stop()


@pytest.fixture(scope="module")
def quiet(servers):
    return servers["quiet"]


@pytest.fixture(scope="module")
def parking(servers):
    return servers["parking"]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(server: Server, messages, session=None, **kw):
    extra = {"session_id": session} if session else None
    return client(server).chat.completions.create(model=MODEL, messages=messages, extra_body=extra,
                                                  **{"max_tokens": 24, "temperature": 0, **kw})


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------ the OpenAI surface
def test_chat_completion_with_usage(quiet):
    r = chat(quiet, QUESTION)
    assert r.object == "chat.completion" and r.model == MODEL
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 20 and 0 < u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0 and u.model_extra["computed_tokens"] == u.prompt_tokens


def test_streaming_gives_the_same_greedy_text_as_a_single_response(quiet):
    whole = chat(quiet, QUESTION).choices[0].message.content
    stream = client(quiet).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens > 0


def test_a_max_tokens_cut_is_finish_reason_length(quiet):
    r = chat(quiet, [{"role": "user", "content": "Write a poem about the sea."}], max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_completions_stream_and_not_and_models(quiet):
    c = client(quiet)
    r = c.completions.create(model=MODEL, prompt="The first three planets are", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 8 and r.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The first three planets are", max_tokens=8, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_logprobs_through_the_openai_client_spell_the_answer_and_greedy_picks_the_likeliest(quiet):
    r = chat(quiet, QUESTION, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - 1          # the end-of-turn token has none
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == t.top_logprobs[0].logprob <= 0 and t.top_logprobs[1].logprob <= t.logprob
    c = client(quiet).completions.create(model=MODEL, prompt="The first three planets are", max_tokens=6,
                                         temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_seeded_sampling_repeats_itself(quiet):
    kw = dict(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12)
    a = chat(quiet, [{"role": "user", "content": "Tell me a fun fact."}], **kw).choices[0].message.content
    b = chat(quiet, [{"role": "user", "content": "Tell me a fun fact."}], **kw).choices[0].message.content
    assert a == b


def test_n_choices_sampled_with_a_seed_differ_and_repeat(quiet):
    kw = dict(temperature=1.0, seed=7, max_tokens=12, n=3)
    a = chat(quiet, [{"role": "user", "content": "Name an animal."}], **kw)
    b = chat(quiet, [{"role": "user", "content": "Name an animal."}], **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1, texts
    greedy = chat(quiet, QUESTION, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def smollm2_tokenizer():
    from residency.dataplane.model.gguf_file import GGUFFile
    from residency.dataplane.model.loader import embedded_model_path
    from residency.dataplane.model.tokenizer import tokenizer_from_gguf
    return tokenizer_from_gguf(GGUFFile(embedded_model_path()).metadata)


def test_a_frequency_penalty_changes_the_greedy_continuation_of_a_repetitive_prompt(quiet):
    la = [{"role": "user", "content": "Repeat after me: " + "la " * 12}]
    plain = chat(quiet, la, max_tokens=40).choices[0].message.content
    stream = client(quiet).chat.completions.create(model=MODEL, messages=la, temperature=0, max_tokens=40,
                                                   frequency_penalty=2.0, stream=True)
    penalized = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert penalized != plain, plain
    # each of n choices counts its own tokens: every one is the text of one choice alone (streamed above)
    three = chat(quiet, la, max_tokens=40, frequency_penalty=2.0, n=3)
    assert [c.message.content for c in three.choices] == [penalized] * 3


def test_a_logit_bias_of_100_makes_greedy_pick_that_token_and_an_id_beyond_the_vocabulary_is_400(quiet):
    tok = smollm2_tokenizer()
    (paris,) = tok.encode(" Paris")
    r = chat(quiet, [{"role": "user", "content": "Name a fruit."}], max_tokens=5, logit_bias={str(paris): 100})
    assert r.choices[0].message.content == tok.decode([paris] * 5)
    c = client(quiet).completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=3, temperature=0,
                                         logit_bias={str(paris): 100})
    assert c.choices[0].text == tok.decode([paris] * 3)
    with pytest.raises(openai.BadRequestError) as e:
        chat(quiet, QUESTION, logit_bias={str(tok.vocab_size): 1})
    assert e.value.body["param"] == "logit_bias" and str(tok.vocab_size) in e.value.body["message"]


# ------------------------------------------------------------------ sessions: moved vs never moved
TURNS = ["Hi! What is the capital of France?", "And what is the capital of Italy?", "Which of the two is bigger?"]


def test_a_session_parked_to_disk_and_restored_between_turns_answers_like_one_never_moved(quiet):
    convo = {"still": [], "moved": []}
    usages = {"still": [], "moved": []}
    for n, text in enumerate(TURNS):
        if n > 0:   # park to host, demote to disk; turn 2 restores by the admin route, turn 3 on demand
            r = quiet.admin("POST", "/admin/sessions/moved/park", json={"tier": "disk"})
            assert r.status_code == 200 and r.json()["tier"] == "disk", r.text
            if n == 1:
                r = quiet.admin("POST", "/admin/sessions/moved/restore")
                assert r.status_code == 200 and r.json()["tier"] == "device", r.text
        for name in ("still", "moved"):
            convo[name].append({"role": "user", "content": text})
            r = chat(quiet, convo[name], session=name, max_tokens=20)
            convo[name].append({"role": "assistant", "content": r.choices[0].message.content})
            usages[name].append(r.usage)
    assert convo["moved"] == convo["still"]
    assert [u.completion_tokens for u in usages["moved"]] == [u.completion_tokens for u in usages["still"]]
    for still, moved in zip(usages["still"][1:], usages["moved"][1:]):
        assert moved.prompt_tokens_details.cached_tokens == still.prompt_tokens_details.cached_tokens > 0
        assert still.model_extra["restored_tokens"] == 0
        assert moved.model_extra["computed_tokens"] == moved.prompt_tokens - moved.prompt_tokens_details.cached_tokens
    assert usages["moved"][1].model_extra["restored_tokens"] == 0          # the admin route restored it before
    assert usages["moved"][2].model_extra["restored_tokens"] == usages["moved"][2].prompt_tokens_details.cached_tokens


def test_a_session_parked_to_host_comes_back_by_a_pipelined_restore_like_one_never_moved(quiet):
    """Its Generate goes as soon as the restore is dispatched; the prefill reads each layer as it
    lands (the same greedy tokens; its moves are the plain restore's, checked on replay below)."""
    convo = {"still": [], "piped": []}
    for n, text in enumerate(TURNS):
        if n > 0:
            r = quiet.admin("POST", "/admin/sessions/piped-h/park", json={"tier": "host"})
            assert r.status_code == 200 and r.json()["tier"] == "host", r.text
        for name in ("still", "piped"):
            convo[name].append({"role": "user", "content": text})
            r = chat(quiet, convo[name], session=name + "-h", max_tokens=20)
            convo[name].append({"role": "assistant", "content": r.choices[0].message.content})
            if name == "piped" and n > 0:
                assert r.usage.model_extra["restored_tokens"] == r.usage.prompt_tokens_details.cached_tokens > 0
    assert convo["piped"] == convo["still"]
    text = httpx.get(quiet.url + "/metrics").text
    # these two from the host, and the disk-parked session's turn above that restored from disk
    assert 'residency_restores_total{path="pipelined"} 3.0' in text, text
    assert 'residency_restores_total{path="plain"}' not in text, text


def test_admin_routes_check_the_key_and_the_session(quiet):
    assert quiet.admin("POST", "/admin/sessions/moved/park", key=None).status_code == 401
    r = quiet.admin("POST", "/admin/sessions/moved/park", key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    r = quiet.admin("POST", "/admin/sessions/no-such-session/restore")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = quiet.admin("GET", "/admin/sessions/still")
    assert r.status_code == 200 and r.json()["tier"] == "device" and r.json()["num_blocks"] > 0
    listed = quiet.admin("GET", "/admin/sessions").json()
    by_name = {x["session_id"]: x for x in listed["data"]}
    assert {"still", "moved"} <= set(by_name) and listed["total"] == len(listed["data"])
    assert by_name["still"] == r.json()


def test_the_quiet_ledger_replays_clean_and_the_reference_never_moved(quiet):
    assert quiet.stop() == 0, quiet.tail()
    events, state = read_ledger(quiet.ledger)
    state.check_integrity()
    assert not state.inflight and state.stranded_bytes_total() == 0
    # a release (src == dst) names its session too, but copies nothing anywhere
    moves = [e.event for e in events if type(e.event).__name__ == "MoveRequested" and e.event.session is not None
             and e.event.src != e.event.dst]
    assert {m.session for m in moves} == {"moved", "piped-h"}, "nothing but the moved sessions may have moved"
    piped = [(m.kind, m.src, m.dst) for m in moves if m.session == "piped-h"]
    assert piped == [("park", "device", "host"), ("restore", "host", "device")] * 2    # as a plain restore's
    moves = [m for m in moves if m.session == "moved"]
    kinds = [(m.kind, m.src, m.dst) for m in moves]
    assert kinds.count(("park", "device", "host")) == 2 and kinds.count(("demote", "host", "disk")) == 2
    assert kinds.count(("restore", "disk", "device")) == 2
    names = [type(e.event).__name__ for e in events]
    assert names.count("SessionRestored") == 4 and names.count("RequestAdmitted") == names.count("RequestFinished")
    # every forward step names its path: on this CPU host no graph exists, so each one is eager
    steps = [e.event for e in events if type(e.event).__name__ == "StepCompleted"]
    assert steps and {s.decode_path for s in steps} == {"eager"}
    restored = [e.event for e in events if type(e.event).__name__ == "SessionRestored"]
    assert all(r.session in ("moved", "piped-h") and r.restored_tokens > 0 for r in restored)
    # byte for byte: every copy of a page carries the checksum the page had when it was parked
    by_id = {m.move_id: m for m in moves}
    sums: dict[int, set[int]] = {}
    for e in events:
        ack = e.event
        if type(ack).__name__ == "MoveAcked" and ack.move_id in by_id:
            for b, c in zip(by_id[ack.move_id].blocks, ack.checksum_list()):
                sums.setdefault(b, set()).add(c)
    assert sums and all(len(c) == 1 for c in sums.values())


# ------------------------------------------------------------------ bad input, disconnects, the policy
def err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if code is not None:
        assert body["code"] == code, body
    return body


def post(server: Server, body, path="/v1/chat/completions") -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


def test_bad_requests_get_openai_shaped_errors(parking):
    ok = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    err(post(parking, b"{not json"), 400, "invalid_json")
    err(post(parking, {**ok, "model": "gpt-17"}), 404, "model_not_found")
    assert err(post(parking, {"model": MODEL}), 400)["param"] == "messages"
    assert err(post(parking, {**ok, "messages": []}), 400)["param"] == "messages"
    assert err(post(parking, {**ok, "max_tokens": -3}), 400)["param"] == "max_tokens"
    assert err(post(parking, {**ok, "temperature": -0.5}), 400)["param"] == "temperature"
    assert err(post(parking, {**ok, "max_tokens": 10**9}), 400, "context_length_exceeded")["param"] == "max_tokens"
    long = [{"role": "user", "content": "word " * 1500}]
    assert err(post(parking, {**ok, "messages": long}), 400, "context_length_exceeded")["param"] == "messages"
    err(post(parking, {"model": MODEL, "prompt": "word " * 1500}, "/v1/completions"), 400, "context_length_exceeded")
    huge = [{"role": "user", "content": "ab" * (1 << 20)}]   # refused before it is encoded: the worker stays
    assert "characters" in err(post(parking, {**ok, "messages": huge}), 400, "context_length_exceeded")["message"]
    with pytest.raises(openai.BadRequestError):
        chat(parking, QUESTION, temperature=-1)
    assert chat(parking, QUESTION, max_tokens=4).usage.completion_tokens <= 4, "still serving"


def test_a_client_that_leaves_mid_stream_has_its_pages_freed_and_the_free_recorded(parking):
    other: dict = {}
    t = threading.Thread(target=lambda: other.update(r=chat(parking, QUESTION, max_tokens=12)))
    body = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{parking.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):   # a token's text (not the role's "")
                    seen += 1
                    if seen == 1:
                        t.start()
                    if seen >= 3:
                        request_id = chunk["id"]
                        break
    t.join(120)
    assert "Paris" in other["r"].choices[0].message.content, "the others keep being served"
    parking.disconnected = request_id
    log = parking.tail(10**6)
    assert "api_unhandled_error" not in log and "Traceback" not in log, "a client leaving is not a server error"


def test_an_idle_session_is_parked_by_the_policy_and_its_next_turn_restored(parking):
    convo = [{"role": "user", "content": TURNS[0]}]
    r = chat(parking, convo, session="idle", max_tokens=16)
    convo += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": TURNS[1]}]
    deadline = time.monotonic() + 30
    while parking.admin("GET", "/admin/sessions/idle").json()["tier"] != "host":
        assert time.monotonic() < deadline, "the policy never parked the idle session"
        time.sleep(0.25)
    r2 = chat(parking, convo, session="idle", max_tokens=16)
    assert r2.model_extra["session_id"] == "idle"
    assert r2.usage.model_extra["restored_tokens"] > 0
    assert r2.usage.model_extra["restored_tokens"] == r2.usage.prompt_tokens_details.cached_tokens


def test_metrics_and_health(parking):
    assert httpx.get(parking.url + "/health").json()["status"] == "ok"
    text = httpx.get(parking.url + "/metrics").text
    for needle in ('residency_http_requests_total{route="/v1/chat/completions",status="400"}',
                   'residency_time_to_first_token_seconds_count{endpoint="chat"}',
                   "residency_inter_token_latency_seconds_bucket",
                   'residency_moves_total{kind="park",outcome="MoveAcked"}',
                   'residency_moves_total{kind="restore",outcome="MoveAcked"}',
                   'residency_tier_used_bytes{tier="host",worker="0"}',
                   "residency_stranded_bytes 0.0", "residency_ledger_append_lag_seconds",
                   'residency_prompt_tokens_total{source="restored"}',
                   'residency_generations_finished_total{reason="disconnected"}'):
        assert needle in text, needle


def test_the_parking_ledger_replays_clean_with_the_disconnect_recorded(parking):
    assert parking.stop() == 0, parking.tail()
    events, state = read_ledger(parking.ledger)
    state.check_integrity()
    rid = parking.disconnected
    mine = [e.event for e in events if e.envelope.correlation_id == rid]
    names = [type(e).__name__ for e in mine]
    assert names[0] == "RequestAdmitted" and "BlocksCommitted" in names
    freed = [e for e in mine if type(e).__name__ == "BlocksFreed"]
    committed = {b for e in mine if type(e).__name__ == "BlocksCommitted" for b in e.blocks}
    assert len(freed) == 1 and freed[0].reason == "disconnected" and set(freed[0].blocks) == committed
    finished = [e for e in mine if type(e).__name__ == "RequestFinished"]
    assert finished[0].reason == "disconnected" and 3 <= finished[0].completion_tokens < 400
    refused = [e.event for e in events if type(e.event).__name__ == "RequestRefused"]
    assert sum("context_length_exceeded" in e.reason for e in refused) == 4
    parks = [e.event for e in events if type(e.event).__name__ == "SessionParked" and e.event.session == "idle"]
    assert parks and parks[0].tier == "host"

