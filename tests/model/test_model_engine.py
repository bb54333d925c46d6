"""The small engine: prefix reuse by content key, continuous batching, slot bookkeeping,
sampling; and the content keys themselves."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import (
    BlockManager,
    LocalEngine,
    OutOfSlots,
    SamplingParams,
    block_content_keys,
    generate,
    sample,
)
from residency.dataplane.model.prefix import KeyChain
from residency.dataplane.model.sampler import token_logprobs

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def ids(gen, n):
    return torch.randint(0, 311, (n,), generator=gen).tolist()


# ------------------------------------------------------------------ content keys
def test_keys_chain_over_the_prefix_and_cover_full_blocks_only():
    toks = list(range(100))
    keys = block_content_keys(toks, 16, "m1")
    assert len(keys) == 6                                          # 96 tokens in full blocks
    assert block_content_keys(toks[:50], 16, "m1") == keys[:3]     # a prefix shares its keys
    changed = toks[:]
    changed[20] = 999                                              # inside block 1
    k2 = block_content_keys(changed, 16, "m1")
    assert k2[0] == keys[0] and all(a != b for a, b in zip(k2[1:], keys[1:]))
    assert block_content_keys(toks, 16, "m2")[0] != keys[0]        # other weights/numerics
    assert len(set(block_content_keys([1] * 64, 16, "m1"))) == 4   # same tokens, other positions


def test_keychain_extends_like_the_pure_function():
    toks, chain, got = list(range(77)), KeyChain("m", 8), []
    for n in (3, 8, 9, 40, 77):
        got += chain.extend(toks[:n])
    assert got == block_content_keys(toks, 8, "m")


# ------------------------------------------------------------------ block manager
def test_block_manager_keeps_its_books_under_random_use(rng):
    bm = BlockManager(32)
    held: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if op < 0.4 and bm.num_available() >= 3:
            keys = [f"k{rng.randrange(6)}-{i}" for i in range(rng.randrange(3))]
            hit = bm.lookup(keys)                   # hits leave the evictable set
            if bm.num_available() < 3:
                bm.release(hit)
                continue
            new = bm.allocate(3)
            for s in new[: rng.randrange(4)]:
                bm.commit(s, f"k{rng.randrange(6)}-{rng.randrange(3)}")
            held.append(hit + new)
        elif held:
            bm.release(held.pop(rng.randrange(len(held))))
        bm.check_integrity()
    for h in held:
        bm.release(h)
    bm.check_integrity()
    assert bm.num_available() == 32


def test_block_manager_refuses_with_the_numbers():
    bm = BlockManager(4)
    bm.allocate(3)
    with pytest.raises(OutOfSlots, match="asked 2 blocks, 1 free and 0 evictable of 4"):
        bm.allocate(2)


def test_integrity_check_catches_a_double_free():
    bm = BlockManager(4)
    s = bm.allocate(1)
    bm.release(s)
    bm.free.append(s[0])                        # the bug: a second free of the same slot
    with pytest.raises(AssertionError, match="overlap|!="):
        bm.check_integrity()


# ------------------------------------------------------------------ engine
def test_prefix_hit_reuses_blocks_and_changes_no_bits(tiny_invariant, gen):
    shared = ids(gen, 70)
    a, b = shared + ids(gen, 9), shared + ids(gen, 12)
    eng = LocalEngine(tiny_invariant, num_blocks=64, page_tokens=16)
    ra = eng.add_request(a, GREEDY)
    eng.run_until_done()
    rb = eng.add_request(b, GREEDY)
    eng.run_until_done()
    assert eng.done[ra].num_cached == 0
    assert eng.done[rb].num_cached == 64                        # 4 full blocks of the shared 70
    cold = LocalEngine(tiny_invariant, num_blocks=64, page_tokens=16, prefix_cache=False)
    rc = cold.add_request(b, GREEDY)
    cold.run_until_done()
    assert eng.done[rb].generated == cold.done[rc].generated
    eng.blocks.check_integrity()
    assert eng.blocks.num_available() == 64


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_invariant, gen):
    p = ids(gen, 48)                                            # exactly 3 blocks
    eng = LocalEngine(tiny_invariant, num_blocks=32, page_tokens=16)
    r1 = eng.add_request(p, GREEDY)
    eng.run_until_done()
    r2 = eng.add_request(p, GREEDY)
    eng.run_until_done()
    assert eng.done[r2].num_cached == 32                        # blocks before the last token only
    assert eng.done[r2].generated == eng.done[r1].generated


def test_new_requests_join_running_decodes(tiny_invariant, gen):
    prompts = [ids(gen, n) for n in (30, 5, 61, 17)]
    solo = [generate(tiny_invariant, [p], GREEDY)[0].token_ids for p in prompts]
    eng = LocalEngine(tiny_invariant, num_blocks=64, page_tokens=16, max_batch_tokens=40)
    rids, steps = [], 0
    while len(rids) < len(prompts) or eng.has_unfinished():
        if len(rids) < len(prompts) and steps % 3 == 0:        # a new arrival every third step
            rids.append(eng.add_request(prompts[len(rids)], GREEDY))
        emitted = eng.step()
        steps += 1
        assert len(emitted) <= len(eng.running) + len(eng.done)
    assert [eng.done[r].generated for r in rids] == solo
    # the batches really were mixed: more than one request emitted in some step
    assert steps < sum(len(s) for s in solo)


def test_generation_stops_at_eos_and_max_tokens(tiny_fast):
    outs = generate(tiny_fast, [[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(outs[0].token_ids) == 5 and outs[0].finish_reason == "length"
    first = outs[0].token_ids[0]
    stop = generate(tiny_fast, [[1, 2, 3]], SamplingParams(max_tokens=5, stop_token_ids=frozenset({first})))
    assert stop[0].token_ids == [first] and stop[0].finish_reason == "stop"


def test_a_request_larger_than_the_pool_is_refused_by_name(tiny_fast):
    eng = LocalEngine(tiny_fast, num_blocks=2, page_tokens=16)
    eng.add_request(list(range(40)), GREEDY)
    with pytest.raises(OutOfSlots, match="needs 4 blocks, the pool has 2"):
        eng.step()


# ------------------------------------------------------------------ sampler
def test_top_p_samples_only_from_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    # probabilities 0.726, 0.267, 0.005, ...: a top_p of 0.7 keeps one token, 0.8 keeps two
    for top_p, nucleus in ((0.7, {0}), (0.8, {0, 1})):
        p = SamplingParams(temperature=1.0, top_p=top_p)
        assert {sample(logits, [p], [g])[0] for _ in range(200)} == nucleus


def test_greedy_ties_go_to_the_lowest_id():
    assert sample(torch.tensor([[1.0, 3.0, 3.0]]), [SamplingParams()], [None]) == [1]


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.tensor([sample(logits, [p], [g])[0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_token_logprobs_are_the_raw_log_softmax_with_each_rows_own_top_k():
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 4
    logits[2, [7, 9]] = 30.0                                    # a tie at the top: the lower id first
    got = token_logprobs(logits, [5, 0, 9], [2, 0, 3])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, tok in enumerate([5, 0, 9]):
        assert got[i][0] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert [len(top) for _, top in got] == [2, 0, 3]
    assert [i for i, _ in got[0][1]] == ref[0].topk(2).indices.tolist()
    assert [i for i, _ in got[2][1]][:2] == [7, 9] and got[2][1][0][1] == got[2][1][1][1]
    assert all(lp == pytest.approx(ref[0, i].item(), abs=1e-5) for i, lp in got[0][1])


def test_sampling_params_refuse_nonsense():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_block_manager_evicts_least_recently_used_cached_blocks():
    bm = BlockManager(3)
    a = bm.allocate(3)
    for s, k in zip(a, "xyz"):
        bm.commit(s, k)
    bm.release([a[1]])
    bm.release([a[0]])
    bm.release([a[2]])
    assert bm.lookup(["x"]) == [a[0]]                           # x is used again: most recent
    new = bm.allocate(2)                                        # evicts y then z, keeps x
    assert set(new) == {a[1], a[2]} and bm.lookup(["y"]) == [] and "x" in bm.by_key
