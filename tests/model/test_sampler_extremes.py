"""Sampling parameters at the edges of their ranges draw a token; they never raise mid-step (a raise
there left the whole batch's requests unanswered)."""
import random

import pytest
import torch

from residency.dataplane.model.sampler import SamplingParams, make_generator, sample


@pytest.mark.parametrize("temperature,top_p", [(1e-300, 1.0), (5e-324, 0.5), (2.0, 1e-300), (1e-300, 1e-300),
                                               (1e-6, 1.0)])
def test_extreme_temperatures_and_top_p_draw_the_best_token(temperature, top_p):
    rng = random.Random()
    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 5
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=1, seed=rng.randrange(1 << 30))] * 3
    got = sample(logits, params, [make_generator(p, "cpu") for p in params])
    assert got == logits.argmax(dim=-1).tolist()


def test_logits_with_no_finite_mass_draw_the_best_token_instead_of_raising():
    logits = torch.full((1, 11), float("-inf"))
    logits[0, 7] = float("inf")
    p = SamplingParams(temperature=1.0, max_tokens=1, seed=3)
    assert sample(logits, [p], [make_generator(p, "cpu")]) == [7]
