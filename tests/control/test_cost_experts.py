"""The cost model prices an expert fetch (fetch vs wait) from the bandwidth expert copies measured."""
from __future__ import annotations

import random

from residency.control.scheduler.cost import CostModel
from residency.events.catalog import ExpertMove


def test_expert_copies_teach_the_host_bandwidth_and_evictions_teach_nothing():
    rng = random.Random()
    cost = CostModel(host_to_device_bytes_per_s=1e9, smoothing=1.0)     # the last observation wins
    nbytes = rng.randrange(1, 64) << 20
    moves = [ExpertMove(kind="fetch", layer=0, expert=3, bytes=nbytes, ns=2_000_000),
             ExpertMove(kind="prefetch", layer=1, expert=5, bytes=nbytes, ns=2_000_000),
             ExpertMove(kind="evict", layer=0, expert=9, bytes=nbytes, ns=0),
             ExpertMove(kind="fetch", layer=2, expert=1, bytes=nbytes, ns=None)]     # not measured: left out
    cost.observe_expert_moves(moves)
    assert cost.bandwidth["host"] == 2 * nbytes / 4e-3
    before = cost.bandwidth["host"]
    cost.observe_expert_moves([ExpertMove(kind="evict", layer=0, expert=1, bytes=nbytes, ns=0)])
    assert cost.bandwidth["host"] == before


def test_a_fetch_is_priced_at_the_measured_bandwidth_less_what_it_hides_behind():
    cost = CostModel(host_to_device_bytes_per_s=50e9)
    demand = cost.price_expert_fetch(12 << 20)
    assert demand.hidden_s == 0 and demand.wait_s == demand.fetch_s == (12 << 20) / 50e9
    ahead = cost.price_expert_fetch(12 << 20, hidden_s=demand.fetch_s / 4)
    assert ahead.wait_s == demand.fetch_s * 3 / 4
    assert cost.price_expert_fetch(12 << 20, hidden_s=1.0).wait_s == 0.0
