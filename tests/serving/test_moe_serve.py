"""An OLMoE-family model served by a real ``residency serve`` on the CPU: the chat API answers with
text, and greedy output is the runner's own ``chat`` on the same directory, token for token."""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from residency.dataplane.model import SamplingParams, load_model, random_model
from residency.events import catalog as ev
from residency.dataplane.model.engine import generate
from tests.model.helpers_model import write_hf_dir
from tests.model.test_model_moe import TINY_OLMOE
from tests.serving.server import Server, read_ledger

pytestmark = [pytest.mark.slow]

NAME = "tiny-olmoe"


def wait_for_model(server: Server, name: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"residency serve exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            r = httpx.get(f"{server.url}/v1/models", timeout=2)
            if r.status_code == 200 and any(m["id"] == name for m in r.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"residency serve not ready after {timeout_s} s:\n{server.tail()}")


def test_olmoe_directory_is_served_and_greedy_text_equals_the_runners_own(tmp_path, rng):
    path = str(tmp_path / NAME)
    write_hf_dir(path, random_model(TINY_OLMOE, seed=rng.randrange(1 << 30)))
    server = Server(tmp_path, "--model", path, "--no-policies")
    messages = [{"role": "user", "content": "hello world, the MoE"}]
    try:
        wait_for_model(server, NAME)
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": NAME, "messages": messages, "max_tokens": 0})
    finally:
        assert server.stop() == 0, server.tail()

    answer = body["choices"][0]["message"]["content"]
    assert body["model"] == NAME and body["usage"]["completion_tokens"] >= 1
    assert bad.status_code == 400 and "max_tokens" in bad.text

    # the same directory through the runner alone, with the template and stop tokens it ships
    torch.set_num_threads(1)
    model = load_model(path)
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = generate(model, [model.tokenizer.encode(prompt)], SamplingParams(max_tokens=12, temperature=0.0))[0]
    # random weights emit stray bytes: the API's incremental decoder holds back a trailing
    # incomplete UTF-8 sequence, which the one-shot decode renders as U+FFFD
    assert out.text.startswith(answer) and set(out.text[len(answer):]) <= {"\ufffd"}
    assert body["usage"]["completion_tokens"] == len(out.token_ids)
    assert body["choices"][0]["finish_reason"] == out.finish_reason

    events, state = read_ledger(server.ledger)
    finished = [r.event for r in events if type(r.event) is ev.RequestFinished]
    assert [f.completion_tokens for f in finished] == [len(out.token_ids)]   # the 400 was never admitted
