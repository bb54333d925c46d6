"""The serving loop as a reader of the device pool (a tiny random Llama, in process): it refuses a
pool of another page shape, keeps generating the same greedy tokens after a shrink relocated its
pages, and fails its sequences by name on a torn pool (never hangs) until a rebind repairs it."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.model import block_content_keys, random_model
from residency.dataplane.mover import Mover
from residency.dataplane.pools import KVLayout, ReaderRefused
from residency.dataplane.serving import ServingLoop
from residency.dataplane.serving_worker import attach
from residency.dataplane.worker import WorkerCore
from residency.events.commands import CommitBlocks, Generate, ReleaseBlocks, ResizePool, SamplingParams, TokensGenerated
from residency.kernels.checksum import block_checksums, checksums_to_ints
from tests.serving.stack import TINY, ByteTokenizer

P = 4


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=3)


def make(model, tmp_path, name: str, faults: str = "", device_blocks: int = 48):
    kv = KVLayout(TINY.num_layers, P, TINY.num_kv_heads, TINY.head_dim, dtype=torch.float32)
    host = 16 * kv.block_bytes
    mover = Mover(kv, device_blocks, host, tmp_path / name, Mover.pinned_bytes_needed(kv, device_blocks, host),
                  "cpu", fsync=False)
    loop = ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                       model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys)
    core = WorkerCore(mover, 0, WorkerFaults(faults))
    attach(core, loop, kv.block_bytes)
    return mover, loop, core


def gen(rid: str, tokens: list[int], pages: list[int], cached: int = 0, max_tokens: int = 6) -> Generate:
    return Generate(request_id=rid, session="s", token_ids=tokens, block_ids=pages, num_cached_tokens=cached,
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def run(core, loop, *cmds) -> list:
    out = []
    for c in cmds:
        out += core.run(c)
    while loop.has_work():
        out += loop.step()
    return out


def tokens(out, rid) -> list[int]:
    return [t for o in out if isinstance(o, TokensGenerated) and o.request_id == rid for t in o.token_ids]


def final(out, rid) -> TokensGenerated:
    return next(o for o in out if isinstance(o, TokensGenerated) and o.request_id == rid and o.finish_reason)


def sums(mover, blocks) -> list[int]:
    pool = mover.device_pool
    return checksums_to_ints(block_checksums(pool.words, pool.slots_of(blocks), blocks))


def test_a_serving_loop_of_another_page_shape_refuses_to_bind(model, tmp_path):
    kv = KVLayout(TINY.num_layers, 2 * P, TINY.num_kv_heads, TINY.head_dim, dtype=torch.float32)
    mover = Mover(kv, 8, 4 * kv.block_bytes, tmp_path, Mover.pinned_bytes_needed(kv, 8, 4 * kv.block_bytes), "cpu",
                  fsync=False)
    with pytest.raises(ReaderRefused, match=r"reader serving refuses to bind: pool blocks are \(2, 2, 8, 2, 16\)"):
        ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                    model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys)
    assert sorted(mover.device_pool.readers) == ["mover", "staging"]
    mover.close()


def test_greedy_output_is_the_same_after_a_shrink_relocated_the_pages_and_after_a_grow(model, tmp_path):
    g = torch.Generator().manual_seed(11)
    prompt = [int(x) for x in torch.randint(1, 257, (10,), generator=g)]
    more = [int(x) for x in torch.randint(1, 257, (5,), generator=g)]
    runs = {}
    for name, resize in (("moved", True), ("still", False)):
        mover, loop, core = make(model, tmp_path, name)
        core.run(CommitBlocks(request_id="fill", session=None, tier="device", blocks=list(range(900, 930)), seed=7))
        first = run(core, loop, gen("t1", prompt, [1, 2, 3, 4]))             # its pages land in slots 30..33
        turn1 = tokens(first, "t1")
        assert final(first, "t1").finish_reason == "length" and len(turn1) == 6
        history = prompt + turn1                                               # 16 tokens: 4 full pages...
        written = [1, 2, 3]                                                    # ...of which 3 hold computed K/V
        before = sums(mover, written)
        core.run(ReleaseBlocks(release_id="r", tier="device", blocks=list(range(900, 930))))
        if resize:
            (shrunk,) = core.run(ResizePool(rebind_id="a", tier="device", num_slots=6, to_gen=1, deadline_ns=0))
            assert shrunk.error == "" and shrunk.blocks_relocated == 4
            assert shrunk.stamps == {"mover": 1, "staging": 1, "serving": 1}
            assert mover.device_pool.slots_of([1, 2, 3, 4]) == [0, 1, 2, 3]
            assert sums(mover, written) == before                              # byte for byte, where they went
            assert loop.ready(1).pool_gen == 1 and loop.ready(1).readers == ["mover", "serving", "staging"]
        second = run(core, loop, gen("t2", history + more, [1, 2, 3, 4, 5, 6, 7], cached=12))
        runs[name] = (turn1, tokens(second, "t2"))
        if resize:
            (grown,) = core.run(ResizePool(rebind_id="b", tier="device", num_slots=64, to_gen=2, deadline_ns=0))
            assert grown.error == "" and grown.to_slots == 64
            third = run(core, loop, gen("t3", prompt, [40, 41, 42, 43]))
            assert tokens(third, "t3") == turn1                                 # the model still answers the same
        mover.check_integrity()
        mover.close()
    assert runs["moved"] == runs["still"]


def test_a_torn_pool_fails_running_and_new_sequences_by_name_and_a_rebind_in_place_repairs_it(model, tmp_path):
    mover, loop, core = make(model, tmp_path, "torn", faults="miss_stamp=serving")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    core.run(gen("r1", prompt, [1, 2, 3, 4], max_tokens=8))
    loop.step()                                                                 # r1 is running
    (torn,) = core.run(ResizePool(rebind_id="a", tier="device", num_slots=40, to_gen=1, deadline_ns=0))
    assert torn.error == "" and "serving" not in torn.stamps and torn.stamps == {"mover": 1, "staging": 1}
    out = loop.step()                                                           # fails, never hangs
    r1 = final(out, "r1")
    assert r1.finish_reason == "error" and "torn pool" in r1.error and "serving at gen 0" in r1.error
    assert not loop.has_work() and not mover.device_pool.blocks()              # its pages freed: no slot held
    (refused,) = core.run(gen("r2", prompt, [5, 6, 7, 8]))
    assert refused.finish_reason == "error" and "torn pool" in refused.error
    (repaired,) = core.run(ResizePool(rebind_id="b", tier="device", num_slots=40, to_gen=2, deadline_ns=0))
    assert repaired.stamps == {"mover": 2, "staging": 2, "serving": 2} and repaired.blocks_relocated == 0
    done = run(core, loop, gen("r3", prompt, [5, 6, 7, 8], max_tokens=8))
    assert final(done, "r3").finish_reason == "length" and len(tokens(done, "r3")) == 8
    mover.check_integrity()
    mover.close()
