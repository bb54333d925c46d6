"""An OLMoE model whose experts live in (pinned) host memory and visit a budget of device slots:
greedy output and logits equal the all-resident model's bit for bit at 100%, 50% and 25% of the
expert bytes; every copy and eviction is recorded; the residency follows measured routing."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import SamplingParams, SeqInput, generate, random_model
from residency.dataplane.model.expert_policy import (
    ExpertBudgetRefused, RoutingFrequency, choose_prefetch, choose_victims, parse_expert_budget, plan_passes,
    slots_for_budget,
)
from residency.dataplane.model.experts import PINNED_OWNER, offload_model
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.errors import PinnedBudgetExceeded
from tests.model.conftest import poisoned_pool
from tests.model.test_model_moe import TINY_OLMOE


@pytest.fixture
def olmoe(rng):
    return random_model(TINY_OLMOE, seed=rng.randrange(1 << 30))


@pytest.mark.parametrize("budget,slots", [("100%", 16), ("50%", 8), ("25%", 4)])
def test_offloaded_greedy_output_and_logits_equal_the_all_resident_models(olmoe, gen, budget, slots):
    model, off = offload_model(olmoe, parse_expert_budget(budget))
    assert off.S == slots
    prompts = [torch.randint(3, TINY_OLMOE.vocab_size, (n,), generator=gen).tolist() for n in (1, 23, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = generate(olmoe, prompts, params)
    got = generate(model, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the logits themselves, a prefill routing to every expert (passes when they do not fit) and a decode
    ids = prompts[1]
    pools = [poisoned_pool(m.runner, 6, 8) for m in (olmoe, model)]
    for batch in ([SeqInput(ids, 0, [4, 1, 5])], [SeqInput([ids[0]], len(ids), [4, 1, 5, 0])]):
        a, b = (m.runner.forward(batch, p) for m, p in zip((olmoe, model), pools))
        assert torch.equal(a, b)
    off.check_integrity()
    (event,) = off.drain(worker=0, step=1)
    kinds = {m.kind for m in event.moves}
    initial = TINY_OLMOE.num_layers * slots
    if slots == TINY_OLMOE.num_experts:       # everything fits: the placement, then nothing moves
        assert kinds == {"fetch"} and len(event.moves) == initial and event.served_fetched_bytes == 0
    else:
        assert "evict" in kinds and off.totals["fetch"] > initial and event.served_fetched_bytes > 0
    assert event.served_device_bytes > 0 and event.device_bytes == initial * off.expert_bytes
    assert event.fetched_bytes == sum(m.bytes for m in event.moves if m.kind != "evict")
    assert all(m.ns is not None and m.ns >= 0 for m in event.moves)      # measured, on CPU too
    assert off.drain(worker=0, step=2) == []                              # nothing new: no event


def test_batch_invariant_runner_offloaded_equals_its_all_resident_twin(rng, gen):
    seed = rng.randrange(1 << 30)
    plain = random_model(TINY_OLMOE, seed=seed, batch_invariant=True)
    model, _ = offload_model(random_model(TINY_OLMOE, seed=seed, batch_invariant=True), parse_expert_budget("25%"))
    prompts = [torch.randint(3, TINY_OLMOE.vocab_size, (n,), generator=gen).tolist() for n in (7, 12)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in generate(model, prompts, params)] == \
        [o.token_ids for o in generate(plain, prompts, params)]


def test_host_copies_are_registered_with_the_pinned_budget_and_a_short_budget_is_refused(olmoe):
    budget = parse_expert_budget("50%")
    _, off = offload_model(olmoe, budget, pinned=(pinned := PinnedBudget(1 << 30, pin=False)))
    assert sum(g.bytes for g in pinned.grants() if g.owner == PINNED_OWNER) == off.host_bytes_needed
    off.close()
    assert pinned.in_use_bytes == 0
    short = PinnedBudget(off.host_bytes_needed - 1, pin=False)
    with pytest.raises(PinnedBudgetExceeded):
        offload_model(olmoe, budget, pinned=short)
    assert short.in_use_bytes == 0                 # the layers pinned before the refusal were given back


def test_budgets_parse_and_one_that_buys_no_slot_is_refused_with_its_arithmetic():
    assert parse_expert_budget("50%").fraction == 0.5 and parse_expert_budget("0.25").fraction == 0.25
    assert parse_expert_budget("2MiB").bytes == 2 << 20 and parse_expert_budget("6e9").bytes == 6 * 10 ** 9
    assert parse_expert_budget("1").bytes == 1 and parse_expert_budget("1.0").fraction == 1.0
    for bad in ("0%", "150%", "lots", "-3GiB"):
        with pytest.raises(ExpertBudgetRefused):
            parse_expert_budget(bad)
    assert slots_for_budget(parse_expert_budget("25%"), num_layers=16, num_experts=64, expert_bytes=100) == 16
    with pytest.raises(ExpertBudgetRefused, match="1599 bytes buys no device slot.*1600 bytes"):
        slots_for_budget(parse_expert_budget("1599"), num_layers=16, num_experts=64, expert_bytes=100)


def test_hot_experts_stay_and_the_coldest_give_up_their_slots():
    freq = RoutingFrequency(1, 8)
    for _ in range(5):
        freq.observe(0, [9, 0, 7, 0, 1, 0, 0, 0])      # 0 and 2 hot, 4 lukewarm
    f = freq.of(0)
    resident = {0: 0, 2: 1, 4: 2, 6: 3}               # 6 never routed to
    assert choose_victims(resident, keep={5}, freq=f, need=1) == [6]
    assert choose_victims(resident, keep={5, 6}, freq=f, need=2) == [4, 2]
    with pytest.raises(ExpertBudgetRefused):
        choose_victims(resident, keep={0, 2, 4}, freq=f, need=2)
    # the next layer's prefetch: hot experts not resident, into free slots or over colder ones only
    assert choose_prefetch({4: 0, 6: 1}, 0, f, cap=8) == [(0, 6), (2, 4)]
    assert choose_prefetch({0: 0, 2: 1}, 1, f, cap=8) == [(4, None)]    # never a frequency-0 expert
    assert choose_prefetch({0: 0, 2: 1}, 0, f, cap=8) == []
    assert plan_passes([9, 1, 5, 3, 7], 2) == [[1, 3], [5, 7], [9]]


def test_a_layer_routed_to_a_hot_set_keeps_it_resident_through_a_cold_visitor(olmoe):
    """Drive one layer's routing by hand: the hot set stays on the device, the visitor leaves first."""
    model, off = offload_model(olmoe, parse_expert_budget("50%"))      # 8 slots of 16
    off.drain(0, 0)
    H = TINY_OLMOE.hidden
    router = torch.zeros(TINY_OLMOE.num_experts, H)
    x = torch.randn(1, H)

    def route_to(experts: list[int]) -> None:
        r = router.clone()
        for rank, e in enumerate(experts):
            r[e] = x[0] / x[0].dot(x[0]) * (4.0 - 0.5 * rank)     # logits 4, 3.5, 3, 2.5; the rest 0
        off.mlp(x, 0, r, fused=False)

    hot = [10, 11, 12, 13]
    for _ in range(6):
        route_to(hot)
    for visitor in ([14, 15, 10, 11], [0, 1, 12, 13]):
        route_to(visitor)
        route_to(hot)
    assert set(hot) <= set(off.expert_slot[0])
    evicted = [m.expert for m in off.drain(0, 1)[0].moves if m.kind == "evict" and m.layer == 0]
    assert not set(evicted) & set(hot)


@pytest.mark.parametrize("hot_layer,run_layer", [(1, 0), (0, -1)], ids=["next_layer", "layer_0_after_the_last"])
def test_a_layers_hot_experts_are_prefetched_while_the_layer_before_it_runs(olmoe, hot_layer, run_layer):
    """A layer's hot set was pushed out by visitors; running the layer before it (for layer 0: the
    step's last layer, ahead of the next step) brings it back ahead of time (recorded as
    prefetches), and the layer then finds it on the device: nothing fetched."""
    _, off = offload_model(olmoe, parse_expert_budget("25%"))      # 4 slots of 16
    H, run_layer = TINY_OLMOE.hidden, run_layer % off.L
    x = torch.randn(1, H)

    def router_for(experts: list[int]) -> torch.Tensor:
        r = torch.zeros(TINY_OLMOE.num_experts, H)
        for rank, e in enumerate(experts):
            r[e] = x[0] / x[0].dot(x[0]) * (4.0 - 0.5 * rank)
        return r

    hot, visitors = [10, 11, 12, 13], [0, 1, 2, 3]
    for _ in range(5):
        off.mlp(x, hot_layer, router_for(hot), fused=False)
    off.mlp(x, hot_layer, router_for(visitors), fused=False)        # the hot set leaves its layer
    assert not set(hot) & set(off.expert_slot[hot_layer])
    off.drain(0, 1)
    off.mlp(x, run_layer, router_for(visitors), fused=False)        # the layer before runs: the prefetch goes out
    prefetched = [(m.layer, m.expert) for m in off.drain(0, 2)[0].moves if m.kind == "prefetch"]
    assert sorted(prefetched) == [(hot_layer, e) for e in hot]
    before = off.served_totals()
    off.mlp(x, hot_layer, router_for(hot), fused=False)
    after = off.served_totals()
    assert (after[0] - before[0], after[1] - before[1]) == (4 * off.expert_bytes, 0)    # all four on the device
    assert not [m for e in off.drain(0, 3) for m in e.moves if m.kind == "fetch"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the fused kernel over slots, the prefetch side stream")
@pytest.mark.parametrize("budget", ["50%", "25%"])
def test_on_the_gpu_offloaded_logits_and_tokens_equal_the_all_resident_models(rng, gen, budget):
    """The GPU path: Triton passes over slot stacks, prefetches on a side stream overlapping the
    layer before, copies timed by CUDA events. bfloat16, as served."""
    resident = random_model(TINY_OLMOE, device="cuda", dtype=torch.bfloat16, seed=rng.randrange(1 << 30))
    model, off = offload_model(resident, parse_expert_budget(budget))
    assert all(b.pinned for b in off._buffers)
    prompts = [torch.randint(3, TINY_OLMOE.vocab_size, (n,), generator=gen).tolist() for n in (1, 40, 17, 5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in generate(model, prompts, params)] == \
        [o.token_ids for o in generate(resident, prompts, params)]
    ids = prompts[1]
    pools = [m.runner.allocate_kv_pool(8, 8).fill_(float("nan")) for m in (resident, model)]
    for batch in ([SeqInput(ids, 0, [4, 1, 5, 7, 2])], [SeqInput([ids[0]], len(ids), [4, 1, 5, 7, 2, 0])]):
        a, b = (m.runner.forward(batch, p) for m, p in zip((resident, model), pools))
        assert torch.equal(a, b)
    (event,) = off.drain(0, 1)
    kinds = {m.kind for m in event.moves}
    assert {"fetch", "evict"} <= kinds and all(m.ns is not None and m.ns > 0 for m in event.moves if m.kind != "evict")
    off.check_integrity()
    off.close()
