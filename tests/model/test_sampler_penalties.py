"""Presence, frequency and repetition penalties and logit_bias in the sampler: the batched torch path
against a per-token reference, on fresh random logits and random histories."""
from __future__ import annotations

import collections
import random

import pytest
import torch

from residency.dataplane.model.penalties import apply_penalties
from residency.dataplane.model.sampler import SamplingParams, make_generator, sample
from residency.events.serving import SamplingParams as WireSampling

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def penalties_ref(row: torch.Tensor, p: SamplingParams, tokens: list[int], num_prompt: int) -> torch.Tensor:
    """One row, one token at a time, as the rules read: bias, then repetition over prompt and
    completion, then frequency and presence over the completion."""
    x = row.double().clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(tokens):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in collections.Counter(tokens[num_prompt:]).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x.float()


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["none", "freq", "pres", "rep", "bias", "all"])
    kw = {}
    if kind in ("freq", "all"):
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if kind in ("pres", "all"):
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if kind in ("rep", "all"):
        kw["repetition_penalty"] = rng.uniform(0.5, 2.0)
    if kind in ("bias", "all"):
        kw["logit_bias"] = {t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), rng.randint(1, 6))}
    return SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=8, seed=rng.randrange(1 << 30), **kw)


def random_history(rng: random.Random, vocab: int) -> tuple[list[int], int]:
    # a small alphabet so tokens repeat, in the prompt and in the completion
    alphabet = rng.sample(range(vocab), rng.randint(1, 12))
    n_prompt, n_gen = rng.randint(1, 30), rng.randint(0, 30)
    return [rng.choice(alphabet) for _ in range(n_prompt + n_gen)], n_prompt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trial", range(6))
def test_the_batched_penalties_match_the_per_token_reference(device, trial):
    rng = random.Random()
    vocab, batch = rng.randint(17, 301), rng.randint(1, 9)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 4
    params = [random_params(rng, vocab) for _ in range(batch)]
    histories = [random_history(rng, vocab) for _ in range(batch)]
    before = logits.clone()
    got = apply_penalties(logits.to(device), params, histories).cpu()
    assert torch.equal(logits, before), "the step's logits were written"
    want = torch.stack([penalties_ref(logits[i], p, *histories[i]) for i, p in enumerate(params)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_counts_are_over_the_completion_and_repetition_over_prompt_and_completion():
    logits = torch.tensor([[2.0, -2.0, 3.0, 1.0]] * 3)
    tokens, num_prompt = [0, 1, 2, 2, 2], 2       # prompt [0, 1]; generated [2, 2, 2]
    freq = SamplingParams(frequency_penalty=0.5)
    pres = SamplingParams(presence_penalty=0.5)
    rep = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(logits, [freq, pres, rep], [(tokens, num_prompt)] * 3)
    assert got[0].tolist() == [2.0, -2.0, 1.5, 1.0]        # 3 - 0.5 * 3: the prompt's 0 and 1 are not counted
    assert got[1].tolist() == [2.0, -2.0, 2.5, 1.0]        # once, however many times
    assert got[2].tolist() == [1.0, -4.0, 1.5, 1.0]        # seen: positive halved, negative doubled; 3 unseen


def test_rows_without_penalties_keep_their_logits_and_no_row_asks_returns_them_as_they_are():
    rng = random.Random()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    plain = SamplingParams()
    assert apply_penalties(logits, [plain] * 3, None) is logits
    got = apply_penalties(logits, [plain, SamplingParams(frequency_penalty=1.0), plain],
                          [([1, 2], 1), ([3, 4, 4], 1), ([5], 1)])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 4] == logits[1, 4] - 2.0 and got[1, 3] == logits[1, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_applies_the_penalties_before_its_argmax(device):
    rng = random.Random()
    vocab = rng.randint(20, 200)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    best = logits.argmax(dim=-1).tolist()
    # the best token was generated 3 times: a frequency penalty of 2 costs it 6, more than any gap here
    gap = float(logits[0].max() - logits[0].min())
    assert gap < 6 * 2
    hist = [([0], 1) if best[0] != 0 else ([1], 1)]
    hist[0] = (hist[0][0] + [best[0]] * 3, 1)
    p = [SamplingParams(temperature=0.0, frequency_penalty=2.0),
         SamplingParams(temperature=0.0, logit_bias={(best[1] + 1) % vocab: 100.0})]
    got = sample(logits.to(device), p, [None, None], [hist[0], ([0], 1)])
    assert got[0] != best[0]
    assert got[0] == apply_penalties(logits[:1], p[:1], hist).argmax().item()
    assert got[1] == (best[1] + 1) % vocab


@pytest.mark.parametrize("device", DEVICES)
def test_a_sampled_row_draws_from_the_penalized_distribution(device):
    rng = random.Random()
    vocab = rng.randint(20, 200)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    want = rng.randrange(vocab)
    p = SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), logit_bias={want: 100.0})
    g = make_generator(p, device)
    assert {sample(logits.to(device), [p], [g], [([0], 1)])[0] for _ in range(20)} == {want}
    # the whole distribution: -100 on every token but one leaves only that one
    other = (want + 1) % vocab
    p = SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30),
                       logit_bias={t: -100.0 for t in range(vocab) if t != other})
    assert {sample(logits.to(device), [p], [make_generator(p, device)], [([0], 1)])[0] for _ in range(20)} == {other}


def test_penalties_without_histories_or_with_ids_outside_the_vocabulary_are_refused_by_name():
    logits = torch.randn(1, 10)
    with pytest.raises(ValueError, match="histories"):
        sample(logits, [SamplingParams(presence_penalty=1.0)], [None])
    with pytest.raises(ValueError, match="token id 10"):
        sample(logits, [SamplingParams(repetition_penalty=1.2)], [None], [([1, 10], 1)])
    with pytest.raises(ValueError, match="logit_bias token id 12"):
        sample(logits, [SamplingParams(logit_bias={12: 1.0})], [None], [([1], 1)])


@pytest.mark.parametrize("kw,said", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"logit_bias": {3: 100.5}}, "logit_bias of token 3"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys"), ({"logit_bias": {"3": 1.0}}, "logit_bias keys"),
])
def test_out_of_range_parameters_are_refused_by_name(kw, said):
    with pytest.raises(ValueError, match=said):
        SamplingParams(**kw)


def test_a_generates_parameters_become_the_workers_and_a_bias_beyond_its_vocabulary_is_refused():
    wire = WireSampling(max_tokens=0, temperature=0.5, presence_penalty=0.25, frequency_penalty=-0.5,
                        repetition_penalty=1.3, logit_bias={7: 4.0})
    p = SamplingParams.of(wire, 9, vocab_size=8)
    assert (p.max_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, dict(p.logit_bias)) == \
        (9, 0.25, -0.5, 1.3, {7: 4.0})
    with pytest.raises(ValueError, match="token id 7 is outside the vocabulary"):
        SamplingParams.of(wire, 9, vocab_size=7)
    assert not SamplingParams.of(WireSampling(max_tokens=1), 1, vocab_size=7).penalized
