"""An OLMoE-family model served by a real ``residency serve`` on the CPU: the chat API answers with
text, and greedy output is the runner's own ``chat`` on the same directory, token for token."""
from __future__ import annotations

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.helpers_moe import NAME, assert_runner_agrees, greedy_chat, tiny_olmoe_served
from tests.serving.server import read_ledger

pytestmark = [pytest.mark.slow]


def test_olmoe_directory_is_served_and_greedy_text_equals_the_runners_own(tmp_path, rng):
    messages = [{"role": "user", "content": "hello world, the MoE"}]
    with tiny_olmoe_served(tmp_path, rng) as (server, path):
        body = greedy_chat(server, messages, 12)
        bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": NAME, "messages": messages, "max_tokens": 0})

    assert body["model"] == NAME and body["usage"]["completion_tokens"] >= 1
    assert bad.status_code == 400 and "max_tokens" in bad.text
    out = assert_runner_agrees(path, messages, 12, body)
    assert body["choices"][0]["finish_reason"] == out.finish_reason

    events, state = read_ledger(server.ledger)
    finished = [r.event for r in events if type(r.event) is ev.RequestFinished]
    assert [f.completion_tokens for f in finished] == [len(out.token_ids)]   # the 400 was never admitted
