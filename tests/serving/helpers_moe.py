"""A tiny OLMoE directory of fresh random weights served by a real ``residency serve``, a greedy
chat to it, and the runner's own answer on the same directory to hold the API's against."""
from __future__ import annotations

from contextlib import contextmanager

import httpx
import torch

from residency.dataplane.model import SamplingParams, load_model, random_model
from residency.dataplane.model.engine import generate
from tests.model.helpers_model import write_hf_dir
from tests.model.test_model_moe import TINY_OLMOE
from tests.serving.server import Server

NAME = "tiny-olmoe"


@contextmanager
def tiny_olmoe_served(tmp_path, rng, *extra: str):
    """Serve a fresh tiny OLMoE (``--no-policies`` and ``extra``) until the block ends, which must
    stop the server cleanly: yields (the server, the model's directory)."""
    path = str(tmp_path / NAME)
    write_hf_dir(path, random_model(TINY_OLMOE, seed=rng.randrange(1 << 30)))
    server = Server(tmp_path, "--model", path, "--no-policies", *extra)
    try:
        server.wait_ready(model=NAME)
        yield server, path
    finally:
        assert server.stop() == 0, server.tail()


def greedy_chat(server: Server, messages: list[dict], max_tokens: int) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def assert_runner_agrees(path: str, messages: list[dict], max_tokens: int, body: dict):
    """The same directory through the runner alone, with the chat template and stop tokens it ships:
    its greedy text is the API's answer (``body``), token for token. Returns the runner's output."""
    torch.set_num_threads(1)
    model = load_model(path)
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = generate(model, [model.tokenizer.encode(prompt)], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    answer = body["choices"][0]["message"]["content"]
    # random weights emit stray bytes: the API's incremental decoder holds back a trailing
    # incomplete UTF-8 sequence, which the one-shot decode renders as U+FFFD
    assert out.text.startswith(answer) and set(out.text[len(answer):]) <= {"\ufffd"}
    assert body["usage"]["completion_tokens"] == len(out.token_ids)
    return out
