"""Residency is a placement decision, never a numerics decision.

* The same bytes in the pool give the same logits, wherever the bytes came from: pages parked
  to a host copy, poisoned, restored into different slots, give bit-identical continuations.
* In batch-invariant mode a token's logits do not depend on how its context was cut into steps
  (prefill A+B == prefill A, then B over the cached pages == decode token by token) nor on what
  shares the batch: bitwise.
* In the default (fast) mode BLAS picks kernels by matrix shape, so those equalities hold to
  rounding only (~1e-7 relative in fp32); greedy tokens still agree, which is checked on SmolLM2.
"""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import SamplingParams, SeqInput
from tests.model.conftest import poisoned_pool

PAGE = 16


def greedy_continue(runner, pool, table, first_logits, start, n):
    """Greedy tokens and every step's logits, decoding from ``first_logits`` at position ``start``."""
    toks, logits = [], [first_logits]
    for i in range(n):
        t = int(logits[-1].argmax())
        toks.append(t)
        logits.append(runner.forward([SeqInput([t], start + i, table)], pool)[0])
    return toks, torch.stack(logits)


def random_ids(gen, n, vocab):
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def test_invariant_prefill_split_anywhere_gives_identical_bits(tiny_invariant, gen):
    r = tiny_invariant.runner
    A, B = random_ids(gen, 293, 311), random_ids(gen, 71, 311)
    table = list(range(30))
    full_pool, split_pool, decode_pool = (poisoned_pool(r, 30, PAGE) for _ in range(3))
    full = r.forward([SeqInput(A + B, 0, table)], full_pool)[0]
    r.forward([SeqInput(A, 0, table)], split_pool)
    split = r.forward([SeqInput(B, len(A), table)], split_pool)[0]
    r.forward([SeqInput(A, 0, table)], decode_pool)
    for i, t in enumerate(B[:-1]):                          # B token by token: the decode path
        r.forward([SeqInput([t], len(A) + i, table)], decode_pool)
    by_decode = r.forward([SeqInput(B[-1:], len(A + B) - 1, table)], decode_pool)[0]
    assert torch.equal(full, split) and torch.equal(full, by_decode)
    n = len(A + B)
    used = [(table[p // PAGE], p % PAGE) for p in range(n)]
    kv = [torch.stack([p[s, :, :, o] for s, o in used]) for p in (full_pool, split_pool, decode_pool)]
    assert torch.equal(kv[0], kv[1]) and torch.equal(kv[0], kv[2])
    t1, l1 = greedy_continue(r, full_pool, table, full, n, 12)
    t2, l2 = greedy_continue(r, split_pool, table, split, n, 12)
    assert t1 == t2 and torch.equal(l1, l2)


def test_invariant_logits_do_not_depend_on_the_batch_around_a_sequence(tiny_invariant, gen):
    r = tiny_invariant.runner
    A = random_ids(gen, 140, 311)
    pool = poisoned_pool(r, 40, PAGE)
    alone = r.forward([SeqInput(A, 0, list(range(9)))], pool)[0]
    pool2 = poisoned_pool(r, 40, PAGE)
    r.forward([SeqInput(random_ids(gen, 50, 311), 0, [30, 31, 32, 33])], pool2)
    crowded = r.forward([
        SeqInput([7], 50, [30, 31, 32, 33]),                     # a decode
        SeqInput(random_ids(gen, 33, 311), 0, [20, 21, 22]),     # another prefill
        SeqInput(A, 0, list(range(9))),
    ], pool2)[2]
    assert torch.equal(alone, crowded)


@pytest.mark.parametrize("invariant", [True, False])
def test_park_poison_restore_elsewhere_continues_bit_identically(tiny_invariant, tiny_fast, gen, invariant):
    """Never moved vs. parked to host, device pages poisoned, restored into other slots."""
    r = (tiny_invariant if invariant else tiny_fast).runner
    prompt = random_ids(gen, 100, 311)
    stay = poisoned_pool(r, 24, PAGE)
    first = r.forward([SeqInput(prompt, 0, list(range(8)))], stay)[0]
    moved = stay.clone()
    host = moved[:7].clone().pin_memory() if torch.cuda.is_available() else moved[:7].clone()   # park
    moved[:7] = float("nan")                                                                   # free
    table = [17, 3, 22, 9, 11, 4, 20, 23]
    moved[torch.tensor(table[:7])] = host.to(moved.device)                                     # restore
    t1, l1 = greedy_continue(r, stay, list(range(8)), first, len(prompt), 20)
    t2, l2 = greedy_continue(r, moved, table, first, len(prompt), 20)
    assert t1 == t2
    assert torch.equal(l1, l2)


def test_fast_mode_split_prefill_is_close_not_bitwise_so_invariant_mode_is_needed(tiny_fast, gen):
    """Documents why ``batch_invariant`` exists: the fast mode differs in the last bits."""
    r = tiny_fast.runner
    A, B = random_ids(gen, 293, 311), random_ids(gen, 71, 311)
    p1, p2 = poisoned_pool(r, 30, PAGE), poisoned_pool(r, 30, PAGE)
    full = r.forward([SeqInput(A + B, 0, list(range(30)))], p1)[0]
    r.forward([SeqInput(A, 0, list(range(30)))], p2)
    split = r.forward([SeqInput(B, len(A), list(range(30)))], p2)[0]
    assert (full - split).abs().max() < 1e-4 * full.abs().max()


@pytest.mark.model
def test_smollm2_split_prefill_gives_the_same_greedy_reply(smollm2):
    """Fast mode on the real model: prefill(A+B) vs prefill(A); prefill(B) over cached pages."""
    tok, r = smollm2.tokenizer, smollm2.runner
    turn1 = [{"role": "user", "content": "Give me one tip for learning to cook."},
             {"role": "assistant", "content": "Start with simple recipes and taste as you go."}]
    A = tok.encode(tok.apply_chat_template(turn1, add_generation_prompt=False))
    AB = tok.encode(tok.apply_chat_template(turn1 + [{"role": "user", "content": "And one for baking bread?"}]))
    assert AB[:len(A)] == A
    B = AB[len(A):]                                          # the second turn, as a server sees it
    table = list(range(20))
    p1, p2 = poisoned_pool(r, 20, PAGE), poisoned_pool(r, 20, PAGE)
    full = r.forward([SeqInput(A + B, 0, table)], p1)[0]
    r.forward([SeqInput(A, 0, table)], p2)
    split = r.forward([SeqInput(B, len(A), table)], p2)[0]
    n = len(A + B)
    t1, l1 = greedy_continue(r, p1, table, full, n, 24)
    t2, l2 = greedy_continue(r, p2, table, split, n, 24)
    print(f"\nmax |logit diff| over 25 steps: {float((l1 - l2).abs().max()):.3g}; reply: {tok.decode(t1)!r}")
    assert t1 == t2


@pytest.mark.model
def test_smollm2_invariant_mode_split_prefill_is_bitwise(smollm2):
    from residency.dataplane.model import ModelRunner

    r = ModelRunner(smollm2.config, smollm2.weights, batch_invariant=True)
    ids = smollm2.tokenizer.encode("Residency moves bytes between tiers; the numbers must not move. " * 3)
    p1, p2 = poisoned_pool(r, 8, PAGE), poisoned_pool(r, 8, PAGE)
    full = r.forward([SeqInput(ids, 0, list(range(8)))], p1)[0]
    r.forward([SeqInput(ids[:37], 0, list(range(8)))], p2)
    assert torch.equal(full, r.forward([SeqInput(ids[37:], 37, list(range(8)))], p2)[0])


def test_sampled_generation_is_reproducible_per_seed(tiny_fast):
    from residency.dataplane.model import generate

    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    a = generate(tiny_fast, [[5, 6, 7, 8]], params)[0].token_ids
    b = generate(tiny_fast, [[5, 6, 7, 8], [9] * 40], params)[0].token_ids    # other company
    c = generate(tiny_fast, [[5, 6, 7, 8]], SamplingParams(temperature=0.9, top_p=0.9, seed=99,
                                                            max_tokens=12, ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_a_restore_landing_layer_by_layer_overlaps_the_prefill_and_changes_no_bits(tiny_fast, gen):
    """A copier thread restores one layer at a time; the forward waits per layer, so it reads
    each layer's pages only after they landed, and computes exactly what it would after a whole copy."""
    import threading
    import time

    r = tiny_fast.runner
    L = r.config.num_layers
    history, turn = random_ids(gen, 96, 311), random_ids(gen, 21, 311)    # the turn starts in a fresh page
    pool = poisoned_pool(r, 16, PAGE)
    r.forward([SeqInput(history, 0, list(range(6)))], pool)
    host = pool[:6].clone()                                                # parked
    pool[:6] = float("nan")
    whole = pool.clone()
    whole[:6] = host
    want = r.forward([SeqInput(turn, 96, list(range(8)))], whole)[0]
    ready = [threading.Event() for _ in range(L)]
    seen = []

    def copier():
        for layer in range(L):
            time.sleep(0.02)                                   # slower than the forward's layers
            pool[:6, layer] = host[:, layer]
            seen.append(layer)
            ready[layer].set()

    t = threading.Thread(target=copier)
    t.start()
    got = r.forward([SeqInput(turn, 96, list(range(8)))], pool, layer_ready=ready)[0]
    t.join()
    assert seen == list(range(L)) and torch.equal(got, want)
