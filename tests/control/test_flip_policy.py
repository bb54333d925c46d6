"""The flip policy (control/flip_policy.py): when requests for a model that is not resident flip
the arena to it, and when they wait."""
from __future__ import annotations

import random

import pytest

from residency.control.flip_policy import Backlog, FlipPolicyConfig, decide, flip_cost_s

S = 1_000_000_000


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    return random.Random(seed)


def sizes(rng) -> dict[str, int]:
    return {"a": rng.randrange(1, 20) * 10**9, "b": rng.randrange(1, 20) * 10**9, "c": rng.randrange(1, 20) * 10**9}


def test_nothing_waiting_for_another_model_never_flips(rng):
    now = rng.randrange(10**15, 10**16)
    d = decide(now, "a", now - 100 * S, 3, [Backlog(model="a", waiting=5, oldest_wait_ns=now - S)], sizes(rng), None)
    assert not d.flip and "no request waits" in d.reason


def test_an_idle_resident_model_flips_at_once_to_the_model_with_the_most_waiting(rng):
    now = rng.randrange(10**15, 10**16)
    d = decide(now, "a", now, 0, [Backlog(model="b", waiting=1, oldest_wait_ns=now),
                                  Backlog(model="c", waiting=2, oldest_wait_ns=now)], sizes(rng), None)
    assert d.flip and d.to_model == "c" and "no request in hand" in d.reason and "assumed" in d.reason


def test_a_busy_resident_model_keeps_the_arena_for_its_minimum_residency(rng):
    now = rng.randrange(10**15, 10**16)
    cfg = FlipPolicyConfig(min_residency_s=rng.uniform(5, 50), assumed_bytes_per_s=1e12)
    held = cfg.min_residency_s * rng.uniform(0.01, 0.99)
    d = decide(now, "a", now - int(held * S), 1, [Backlog(model="b", waiting=9, oldest_wait_ns=now - 3600 * S)],
               sizes(rng), None, cfg)
    assert not d.flip and "minimum" in d.reason
    d = decide(now, "a", now - int((cfg.min_residency_s + 1) * S), 1,
               [Backlog(model="b", waiting=9, oldest_wait_ns=now - 3600 * S)], sizes(rng), None, cfg)
    assert d.flip and d.to_model == "b"


def test_a_busy_resident_model_flips_only_once_the_backlog_waited_longer_than_the_flip_costs(rng):
    now = rng.randrange(10**15, 10**16)
    img = sizes(rng)
    bw = rng.uniform(1e9, 5e10)                 # measured
    cost = flip_cost_s(img["a"], img["b"], bw, FlipPolicyConfig())
    cfg = FlipPolicyConfig(min_residency_s=0.0)
    early = decide(now, "a", 0, 2, [Backlog(model="b", waiting=5, oldest_wait_ns=now - int(cost * 0.5 * S))],
                   img, bw, cfg)
    assert not early.flip and "not yet the flip's cost" in early.reason and "measured" in early.reason
    late = decide(now, "a", 0, 2, [Backlog(model="b", waiting=5, oldest_wait_ns=now - int(cost * 2 * S) - 1)],
                  img, bw, cfg)
    assert late.flip and late.to_model == "b" and late.cost_s == pytest.approx(cost)


def test_a_backlog_no_bigger_than_the_resident_models_stays(rng):
    now = rng.randrange(10**15, 10**16)
    n = rng.randrange(1, 10)
    d = decide(now, "a", 0, n + rng.randrange(0, 3), [Backlog(model="b", waiting=n, oldest_wait_ns=1)], sizes(rng),
               None, FlipPolicyConfig(min_residency_s=0.0))
    assert not d.flip and "no more than" in d.reason
