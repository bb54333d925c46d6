"""Prefix sharing in the worker's loop on every device here (CPU always; the GPU when there is one,
through ``bench/gpu_session.sh tests``): a tiny random Llama, fresh random prompts.

A sequence that reads another session's pages in place and one that copies them into its own
first pages must give the same greedy tokens, and the copies must be the source's bytes exactly
while the source stays unchanged.
"""
from __future__ import annotations

import random

import pytest
import torch

from residency.dataplane.mover import Mover
from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.pools import KVLayout
from residency.dataplane.serving import ServingLoop
from residency.events.commands import Generate, SamplingParams, TokensGenerated
from tests.serving.stack import ByteTokenizer

P = 8
CFG = ModelConfig(name="tiny-share", num_layers=3, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate=256, vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                  max_position=512, tie_embeddings=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def drain(loop: ServingLoop, out: list) -> list:
    while loop.has_work():
        out += loop.step()
    return out


def tokens(out, rid) -> list[int]:
    return [t for o in out if isinstance(o, TokensGenerated) and o.request_id == rid for t in o.token_ids]


@pytest.mark.parametrize("device", DEVICES)
def test_reading_a_shared_prefix_in_place_and_copying_it_give_the_same_tokens(device, tmp_path):
    model = random_model(CFG, device, torch.float32, seed=int.from_bytes(random.randbytes(2), "little"))
    kv = KVLayout(CFG.num_layers, P, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float32)
    blocks, host = 128, 16 * kv.block_bytes
    mover = Mover(kv, blocks, host, tmp_path / "disk", Mover.pinned_bytes_needed(kv, blocks, host), device,
                   fsync=False)
    loop = ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                       model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys)
    rng = random.Random()
    system = [rng.randrange(1, 257) for _ in range(8 * P + 3)]
    a_ids, b_ids = system + [rng.randrange(1, 257) for _ in range(9)], system + [rng.randrange(1, 257) for _ in range(13)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a_pages = list(range(0, -(-(len(a_ids) + 10) // P)))
    drain(loop, loop.handle(Generate(request_id="a", session="a", token_ids=a_ids, block_ids=a_pages,
                                     num_cached_tokens=0, sampling=greedy)))
    k = len(system) // P
    donor = a_pages[:k]
    pool = mover.device_pool
    before = pool.words[pool.slots_of(donor)].clone()
    n = -(-(len(b_ids) + 10) // P)
    read = drain(loop, loop.handle(Generate(request_id="read", session=None, token_ids=b_ids,
                                            block_ids=donor + list(range(100, 100 + n - k)), num_cached_tokens=k * P,
                                            sampling=greedy, free_on_finish=True)))
    own = list(range(200, 200 + n))
    copy = drain(loop, loop.handle(Generate(request_id="copy", session="b", token_ids=b_ids, block_ids=own,
                                            num_cached_tokens=k * P, sampling=greedy, copy_from=donor)))
    if device == "cuda":
        torch.cuda.synchronize()
    assert len(tokens(read, "read")) == 10 and tokens(copy, "copy") == tokens(read, "read")
    assert torch.equal(pool.words[pool.slots_of(own[:k])], before)
    assert torch.equal(pool.words[pool.slots_of(donor)], before)
    pool.check_integrity()
