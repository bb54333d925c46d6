"""The memory view (control/memory.py) from folded events: tenants sum to used, hot and
reclaimable arithmetic, unknown hotness counted hot, and a silent probe shown unknown (None), never 0."""
from __future__ import annotations

import random

from residency.control.fold import fold_decoded
from residency.control.memory import memory_view
from residency.control.state import State
from residency.events import catalog as ev
from residency.events.commands import MemoryReport


def folded(rng: random.Random):
    bb = rng.randrange(1000, 5000)
    weights, scratch = rng.randrange(10**6, 10**7), rng.randrange(1, 10**5)
    events = [
        ev.WorkerJoined(worker=0, device="cuda:0", tiers={"device": 200 * bb, "host": 100 * bb, "disk": 400 * bb},
                        block_bytes=bb, device_owned={"weights": weights, "scratch": scratch}),
        ev.PinnedRegistered(worker=0, owner="host-pool", bytes=100 * bb),
        ev.PinnedRegistered(worker=0, owner="staging-ring", bytes=4 * bb),
        ev.BlocksCommitted(worker=0, session="chat", tier="device", blocks=list(range(0, 10)), keys=[""] * 10, bytes=10 * bb),
        ev.BlocksCommitted(worker=0, session="~p1", tier="device", blocks=list(range(10, 16)), keys=[""] * 6, bytes=6 * bb),
        ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[16, 17], keys=["", ""], bytes=2 * bb),
        ev.BlocksCommitted(worker=0, session="old", tier="host", blocks=list(range(20, 25)), keys=[""] * 5, bytes=5 * bb),
        # a move in flight reads 20, 21 on host and writes them to the device: hot on both until acked
        ev.MoveRequested(move_id="m1", kind="restore", worker=0, src="host", dst="device", blocks=[20, 21],
                         bytes_planned=2 * bb, keep_source=True, deadline_ns=10**18, reason="t", session="old"),
    ]
    state = fold_decoded(State(), ((i + 1, i + 1, e) for i, e in enumerate(events)))
    return state, bb, weights, scratch


def test_tenants_sum_to_used_and_reclaimable_is_used_less_hot():
    rng = random.Random(3)
    state, bb, weights, scratch = folded(rng)
    busy = {0: {1, 2, 3}}
    report = MemoryReport(worker=0, nonce=1, device_total_bytes=10**10, device_free_bytes=0)
    [w] = memory_view(state, busy, {0: report}).workers
    d, h = w.tiers["device"], w.tiers["host"]
    assert d.kv_used_bytes == state.workers[0].tiers["device"].used_bytes == 18 * bb
    assert d.used_bytes == 18 * bb + weights + scratch == d.tenants.total()
    assert (d.tenants.session_kv, d.tenants.retained_prefixes, d.tenants.unowned_kv) == (10 * bb, 6 * bb, 2 * bb)
    assert d.hot_bytes == 3 * bb + weights + scratch and d.reclaimable_bytes == 15 * bb
    assert h.used_bytes == 5 * bb + 4 * bb == h.tenants.total() and h.tenants.pinned_rings == 4 * bb
    assert h.hot_bytes == 2 * bb + 4 * bb and h.reclaimable_bytes == 3 * bb      # 20, 21 are moving
    assert h.pinned_bytes == 104 * bb and d.pinned_bytes == 0
    assert w.probe.answered and w.probe.device_free_bytes == 0                    # a measured zero stays 0


def test_when_hotness_cannot_be_answered_every_resident_device_page_is_hot():
    state, bb, weights, scratch = folded(random.Random(5))
    [w] = memory_view(state, None, {0: None}).workers
    d = w.tiers["device"]
    assert not d.hotness_known and d.reclaimable_bytes == 0 and d.hot_bytes == d.used_bytes
    assert w.tiers["host"].hotness_known


def test_a_probe_that_did_not_answer_is_unknown_not_zero():
    state, *_ = folded(random.Random(9))
    [w] = memory_view(state, {}, {}).workers
    assert not w.probe.answered
    assert w.probe.device_free_bytes is None and w.probe.device_total_bytes is None
    assert w.probe.pinned_in_use_bytes is None


def test_a_lost_worker_is_not_in_the_view_and_its_pins_are_gone():
    state, *_ = folded(random.Random(11))
    fold_decoded(state, [(99, 99, ev.WorkerLost(worker=0, reason="test"))])
    assert memory_view(state, {}, {}).workers == []
    assert state.workers[0].pinned == {} and state.workers[0].device_owned == {}


def test_captured_graphs_are_their_own_owner_and_unmeasured_graphs_are_none_not_zero():
    rng = random.Random()
    bb, weights, scratch, graphs = rng.randrange(1000, 5000), rng.randrange(10**6, 10**7), rng.randrange(1, 10**5), \
        rng.randrange(1, 10**6)
    gpu = ev.WorkerJoined(worker=0, device="cuda:0", tiers={"device": 50 * bb, "host": 10 * bb, "disk": 10 * bb},
                          block_bytes=bb, device_owned={"weights": weights, "scratch": scratch, "graphs": graphs})
    cpu = ev.WorkerJoined(worker=1, device="cpu", tiers={"device": 50 * bb, "host": 10 * bb, "disk": 10 * bb},
                          block_bytes=bb, device_owned={"weights": weights})
    state = fold_decoded(State(), [(1, 1, gpu), (2, 2, cpu)])
    g, c = (w.tiers["device"] for w in memory_view(state, {}, {}).workers)
    assert (g.tenants.graphs, g.tenants.scratch, g.tenants.weights) == (graphs, scratch, weights)
    assert g.used_bytes == weights + scratch + graphs == g.tenants.total() == g.hot_bytes
    assert g.capacity_bytes == 50 * bb + weights + scratch + graphs
    assert c.tenants.graphs is None and c.used_bytes == weights == c.tenants.total()
    assert b'"graphs":null' in __import__("msgspec").json.encode(c.tenants)


def test_graphs_captured_again_after_start_show_as_the_probe_says_now():
    """A pool resize, a flip or a wake captures the decode graphs again (a sleep drops them) with no
    event: the worker's probe carries its books now, and the view believes it over the joined figure."""
    rng = random.Random()
    bb, weights, at_start, now = rng.randrange(1000, 5000), rng.randrange(10**6, 10**7), rng.randrange(1, 10**6), \
        rng.randrange(10**6, 10**7)
    joined = ev.WorkerJoined(worker=0, device="cuda:0", tiers={"device": 50 * bb, "host": 10 * bb, "disk": 10 * bb},
                             block_bytes=bb, device_owned={"weights": weights, "graphs": at_start})
    state = fold_decoded(State(), [(1, 1, joined)])
    probe = MemoryReport(worker=0, nonce=1, device_owned={"weights": weights, "graphs": now})
    [w] = memory_view(state, {}, {0: probe}).workers
    d = w.tiers["device"]
    assert d.tenants.graphs == now and d.used_bytes == weights + now == d.tenants.total()
    asleep = MemoryReport(worker=0, nonce=2, device_owned={"weights": weights})      # dropped: none held
    [w] = memory_view(state, {}, {0: asleep}).workers
    assert w.tiers["device"].tenants.graphs is None and w.tiers["device"].used_bytes == weights
    [w] = memory_view(state, {}, {}).workers                                        # no answer: as it joined
    assert w.tiers["device"].tenants.graphs == at_start
