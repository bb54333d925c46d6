"""A long prompt prefills in chunks beside the running decodes: no decode stream waits for it.

Counted in steps and tokens, never in time: every step while the long prompt prefills also gives
each running stream its next token, and the prefill takes the budget the decodes leave.
"""
from __future__ import annotations

import random

import torch

from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.mover import Mover
from residency.dataplane.pools import KVLayout
from residency.dataplane.serving import ServingLoop
from residency.events.catalog import StepCompleted
from residency.events.commands import Generate, SamplingParams, TokensGenerated
from tests.serving.stack import ByteTokenizer

P = 8
CFG = ModelConfig(name="tiny-chunks", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate=128, vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                  max_position=1024, tie_embeddings=True)
STEP_TOKENS = 32


def test_decode_streams_get_a_token_every_step_while_a_long_prompt_prefills(tmp_path):
    rng = random.Random()
    model = random_model(CFG, "cpu", torch.float32, seed=rng.randrange(1 << 16))
    kv = KVLayout(CFG.num_layers, P, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float32)
    blocks, host = 160, 4 * kv.block_bytes
    mover = Mover(kv, blocks, host, tmp_path / "disk", Mover.pinned_bytes_needed(kv, blocks, host), "cpu", fsync=False)
    loop = ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                       model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys,
                       max_step_tokens=STEP_TOKENS)
    next_page = iter(range(10_000))

    def gen(rid: str, n: int, max_tokens: int) -> Generate:
        ids = [rng.randrange(1, 257) for _ in range(n)]
        return Generate(request_id=rid, session=None, token_ids=ids, num_cached_tokens=0, free_on_finish=True,
                        block_ids=[next(next_page) for _ in range(-(-(n + max_tokens) // P))],
                        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    out = loop.handle(gen("a", 5, 200)) + loop.handle(gen("b", 7, 200))
    while any(s.prefilling for s in loop.seqs.values()):
        out += loop.step()                                   # both streams decoding now
    long_n = 700
    out += loop.handle(gen("long", long_n, 3))
    prefill_steps, per_step = 0, []
    while loop.seqs["long"].prefilling:
        step = loop.step()
        prefill_steps += 1
        got = {o.request_id: len(o.token_ids) for o in step if isinstance(o, TokensGenerated) and o.token_ids}
        per_step.append((got.get("a", 0), got.get("b", 0)))
        (done,) = [o for o in step if isinstance(o, StepCompleted)]
        assert done.num_seqs == 3 and done.num_tokens <= STEP_TOKENS
    # the prefill used exactly the budget the two decodes left, so it took this many steps ...
    assert prefill_steps == -(-long_n // (STEP_TOKENS - 2))
    # ... and in each of them both streams got their next token
    assert per_step == [(1, 1)] * prefill_steps
    assert loop.seqs["long"].num_generated == 1            # its last chunk's step sampled its first token
