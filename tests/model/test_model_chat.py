"""End to end on the embedded SmolLM2: a greedy chat reply is sensible English."""
from __future__ import annotations

import re

import pytest

from residency.dataplane.model import SamplingParams, chat, generate


@pytest.mark.model
def test_greedy_chat_reply_is_sensible_english(smollm2):
    reply = chat(smollm2, [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                 SamplingParams(max_tokens=40))
    print(f"\nSmolLM2 says: {reply!r}")
    assert "Paris" in reply
    words = re.findall(r"[A-Za-z]+", reply)
    assert len(words) >= 4 and sum(len(w) for w in words) > 0.6 * len(reply.replace(" ", ""))


@pytest.mark.model
def test_two_turn_chat_stops_at_end_of_turn_and_reuses_the_first_turn(smollm2):
    from residency.dataplane.model import LocalEngine

    tok = smollm2.tokenizer
    turn1 = [{"role": "user", "content": "Name a fruit that is yellow."}]
    eng = LocalEngine(smollm2, num_blocks=64, page_tokens=16)
    r1 = eng.add_request(tok.encode(tok.apply_chat_template(turn1)), SamplingParams(max_tokens=30))
    eng.run_until_done()
    first = eng.done[r1]
    assert first.finish_reason == "stop" and first.generated[-1] in tok.eos_token_ids
    answer = tok.decode(first.generated, skip_special=True)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "What color is the sky?"}]
    r2 = eng.add_request(tok.encode(tok.apply_chat_template(turn2)), SamplingParams(max_tokens=30))
    eng.run_until_done()
    second = eng.done[r2]
    print(f"\nturn 1: {answer!r}\nturn 2: {tok.decode(second.generated, skip_special=True)!r} "
          f"({second.num_cached} prompt tokens reused from turn 1)")
    assert second.num_cached >= 32                              # the system prompt and turn 1 blocks
    assert "blue" in tok.decode(second.generated).lower()
    batch = generate(smollm2, [tok.encode(tok.apply_chat_template(turn1))], SamplingParams(max_tokens=30))
    assert batch[0].token_ids == first.generated
