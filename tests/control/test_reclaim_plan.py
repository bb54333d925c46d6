"""The reclaim planner (control/reclaim.py), the tenant declarations (control/tenants.py) and the
fold of tenant grants: route order, whole refusal with its arithmetic, rounding to whole pages."""
from __future__ import annotations

import random

import pytest

from residency.control.fold import fold_all
from residency.control.reclaim import Candidate, Pool, ReclaimPlan, ReclaimRefused, plan_reclaim
from residency.control.state import IntegrityError, State, check_integrity
from residency.control.tenants import DEFAULT_ROUTES, TenantError, lookup, parse_tenant, parse_tenants
from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded

BB = 3 * 4096 + 512        # an irregular page size, so rounding shows


def _pool(free=2, capacity=20, floor=0, host_room=1 << 40, context_pages=0):
    return Pool(worker=0, block_bytes=BB, capacity_bytes=capacity * BB, free_pages=free, floor_bytes=floor,
                host_room_bytes=host_room, context_pages=context_pages)


def _cands():
    return [
        Candidate(route="prefixes", session="~r1", pages=(10, 11), to_copy=0),
        Candidate(route="park", session="alice", pages=(1, 2, 3), to_copy=3),
        Candidate(route="park", session="bob", pages=(4, 5), to_copy=1),
        # evict: single pages, some of which the park route would also take
        Candidate(route="evict", session="alice", pages=(3,), to_copy=1),
        Candidate(route="evict", session="carol", pages=(7,), to_copy=1),
        Candidate(route="evict", session="carol", pages=(8,), to_copy=0),
    ]


# ------------------------------------------------------------------ tenants
def test_a_tenant_without_routes_gets_the_default_order():
    assert parse_tenant("trainer").routes == DEFAULT_ROUTES == ("prefixes", "park", "evict")


def test_a_tenant_declares_its_own_route_order():
    assert parse_tenant("trainer=evict,park").routes == ("evict", "park")


@pytest.mark.parametrize("spec, words", [
    ("trainer=park,swap", "unknown route"), ("trainer=", "no route"), ("=park", "tenant name"),
    ("trainer=park,park", "named twice"), ("bad name", "tenant name"),
])
def test_a_bad_tenant_declaration_is_refused_with_the_reason(spec, words):
    with pytest.raises(TenantError, match=words):
        parse_tenant(spec)


def test_a_tenant_declared_twice_is_refused():
    with pytest.raises(TenantError, match="declared twice"):
        parse_tenants(["a=park", "a"])


def test_an_undeclared_tenant_is_refused_naming_the_declared_ones():
    tenants = parse_tenants(["trainer", "judge=evict"])
    with pytest.raises(TenantError, match="judge, trainer"):
        lookup(tenants, "intruder")
    assert lookup(tenants, "judge").routes == ("evict",)


# ------------------------------------------------------------------ the plan
def test_the_ask_is_rounded_up_to_whole_pages():
    plan = plan_reclaim("t", DEFAULT_ROUTES, _pool(free=5), _cands(), BB + 1)
    assert isinstance(plan, ReclaimPlan)
    assert plan.granted_bytes == 2 * BB and plan.to_bytes == 18 * BB
    assert plan.steps == () and plan.pages_to_empty == 0          # the pool had the room already


def test_pages_are_emptied_in_the_tenants_route_order():
    plan = plan_reclaim("t", ("prefixes", "park", "evict"), _pool(free=2), _cands(), 5 * BB)
    assert plan.pages_to_empty == 3
    assert [(s.route, s.session) for s in plan.steps] == [("prefixes", "~r1"), ("park", "alice")]
    plan = plan_reclaim("t", ("evict", "park"), _pool(free=2), _cands(), 5 * BB)
    assert [(s.route, s.session, s.pages) for s in plan.steps] == [
        ("evict", "alice", (3,)), ("evict", "carol", (7,)), ("evict", "carol", (8,))]


def test_a_page_counts_once_under_the_first_route_that_takes_it():
    plan = plan_reclaim("t", ("park", "evict"), _pool(free=0), _cands(), BB)
    assert plan.reclaimable_bytes == {"park": 5 * BB, "evict": 2 * BB}   # page 3 is alice's park


def test_a_route_the_tenant_did_not_name_is_never_used():
    plan = plan_reclaim("t", ("park",), _pool(free=0), _cands(), 5 * BB)
    assert {s.route for s in plan.steps} == {"park"}
    refused = plan_reclaim("t", ("park",), _pool(free=0), _cands(), 6 * BB)
    assert isinstance(refused, ReclaimRefused)


def test_an_ask_above_everything_reclaimable_is_refused_whole_with_the_arithmetic():
    floor = BB + 100
    out = plan_reclaim("trainer", DEFAULT_ROUTES, _pool(free=2, floor=floor), _cands(), 100 * BB)
    assert isinstance(out, ReclaimRefused)
    free, reclaimable = 2 * BB, (2 + 5 + 2) * BB
    assert out.available_bytes == free + reclaimable - floor
    assert out.granted_bytes == 100 * BB and out.floor_bytes == floor
    e = out.event()
    assert type(e) is ev.MoveRefused and e.ask == "tenant:trainer" and e.tier == "device"
    assert e.asked_bytes == 100 * BB and e.available_bytes == out.available_bytes
    for number in (free, reclaimable, floor, out.available_bytes):
        assert str(number) in e.reason


def test_the_largest_ask_that_fits_is_planned_and_one_page_more_is_refused():
    rng = random.Random(27)
    for _ in range(200):
        free, floor = rng.randint(0, 4), rng.randint(0, 3 * BB)
        cands = [Candidate(route=rng.choice(DEFAULT_ROUTES), session=f"s{i}",
                           pages=tuple(rng.sample(range(40), rng.randint(1, 4))), to_copy=rng.randint(0, 2))
                 for i in range(rng.randint(0, 8))]
        pool = _pool(free=free, capacity=60, floor=floor, host_room=rng.randint(0, 6) * BB)
        probe = plan_reclaim("t", DEFAULT_ROUTES, pool, cands, BB)
        available = probe.available_bytes
        top = available // BB
        if top:
            plan = plan_reclaim("t", DEFAULT_ROUTES, pool, cands, top * BB)
            assert isinstance(plan, ReclaimPlan)
            emptied = sum(len(s.pages) for s in plan.steps)
            assert emptied >= plan.pages_to_empty
            # after the moves the pool holds the grant plus the floor in free pages
            assert (free + emptied) * BB - plan.granted_bytes >= floor
            copies = sum(c.to_copy for c in cands)
            assert copies >= 0
        refused = plan_reclaim("t", DEFAULT_ROUTES, pool, cands, (top + 1) * BB)
        assert isinstance(refused, ReclaimRefused), (top, available)


def test_a_park_whose_copies_do_not_fit_on_host_is_not_counted_reclaimable():
    plan = plan_reclaim("t", ("park",), _pool(free=0, host_room=2 * BB), _cands(), BB)
    assert plan.reclaimable_bytes == {"park": 2 * BB}          # bob (1 copy) fits, alice (3) does not
    assert [s.session for s in plan.steps] == ["bob"]


def test_bytes_must_be_positive():
    with pytest.raises(ValueError):
        plan_reclaim("t", DEFAULT_ROUTES, _pool(), _cands(), 0)


# ------------------------------------------------------------------ the fold
def _fold(events) -> State:
    recs = [Recorded(Envelope(producer="t", epoch=1, producer_seq=i, ts_ns=i, seq=i), e)
            for i, e in enumerate(events, 1)]
    return fold_all(State(), recs)


def _joined():
    return ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 20 * BB, "host": 40 * BB, "disk": 0},
                           block_bytes=BB)


def test_the_fold_keeps_each_tenants_grant_until_it_is_released():
    grant = ev.TenantReclaimed(tenant="trainer", worker=0, asked_bytes=BB + 1, granted_bytes=2 * BB,
                               freed_bytes=BB, measured_bytes=None, rebind_id="rb-1", moves=["m-1"])
    s = _fold([_joined(), grant])
    assert s.workers[0].tenants == {"trainer": 2 * BB}
    check_integrity(s)
    s = _fold([_joined(), grant, ev.TenantReleased(tenant="trainer", worker=0, bytes=2 * BB, measured_bytes=None,
                                                   rebind_id="rb-2")])
    assert s.workers[0].tenants == {}
    check_integrity(s)


def test_a_failed_reclaim_grants_nothing():
    s = _fold([_joined(), ev.TenantReclaimFailed(tenant="trainer", worker=0, asked_bytes=BB, reason="stranded",
                                                  stranded_bytes=BB, stranded_moves=["m-2"])])
    assert s.workers[0].tenants == {}
    check_integrity(s)


def test_releasing_more_than_was_granted_is_an_anomaly():
    s = _fold([_joined(), ev.TenantReleased(tenant="trainer", worker=0, bytes=BB, measured_bytes=None,
                                            rebind_id="rb-2")])
    with pytest.raises(IntegrityError, match="trainer"):
        check_integrity(s)


def test_the_grant_is_part_of_the_state_hash():
    grant = ev.TenantReclaimed(tenant="trainer", worker=0, asked_bytes=BB, granted_bytes=BB, freed_bytes=0,
                               measured_bytes=BB, rebind_id="rb-1")
    assert _fold([_joined(), grant]).state_hash() != _fold([_joined()]).state_hash()


# ------------------------------------------------------------------ the audit
def test_audit_tenants_sums_grants_releases_and_what_is_held(tmp_path, capsys):
    import json

    from residency.control.cli.main import main
    from residency.ledger import LedgerStore

    url = f"sqlite:///{tmp_path / 't.db'}"
    events = [_joined(),
              ev.TenantReclaimed(tenant="trainer", worker=0, asked_bytes=3 * BB - 7, granted_bytes=3 * BB,
                                 freed_bytes=BB, measured_bytes=None, rebind_id="rb-1"),
              ev.TenantReclaimFailed(tenant="trainer", worker=0, asked_bytes=BB, reason="stranded",
                                     stranded_bytes=BB, stranded_moves=["m-9"]),
              ev.TenantReclaimed(tenant="judge", worker=0, asked_bytes=BB, granted_bytes=BB, freed_bytes=0,
                                 measured_bytes=BB, rebind_id="rb-2"),
              ev.TenantReleased(tenant="trainer", worker=0, bytes=3 * BB, measured_bytes=None, rebind_id="rb-3")]
    store = LedgerStore.open(url, create=True)
    try:
        store.append([(Envelope(producer="test", epoch=1, producer_seq=i + 1, ts_ns=i + 1), e)
                      for i, e in enumerate(events)])
    finally:
        store.close()
    assert main(["audit", "tenants", "--db", url, "--json"]) == 0
    rows = {r["tenant"]: r for r in json.loads(capsys.readouterr().out)["tenants"]}
    assert rows["trainer"] == {"tenant": "trainer", "worker": 0, "granted_bytes": 3 * BB, "released_bytes": 3 * BB,
                               "held_bytes": 0, "num_reclaims": 1, "num_failed": 1}
    assert rows["judge"]["held_bytes"] == BB
    assert _fold(events).workers[0].tenants == {"judge": BB}       # the fold agrees


def test_the_memory_view_shows_what_each_outside_tenant_holds():
    from residency.control.memory import memory_view

    grant = ev.TenantReclaimed(tenant="trainer", worker=0, asked_bytes=BB, granted_bytes=2 * BB, freed_bytes=0,
                               measured_bytes=None, rebind_id="rb-1")
    view = memory_view(_fold([_joined(), grant]), {0: set()}, {0: None})
    device = view.workers[0].tiers["device"]
    assert view.outside_tenants == {"trainer": 2 * BB} and device.tenants.outside == {"trainer": 2 * BB}
    assert device.tenants.total() == device.used_bytes            # the lent bytes are on the books ...
    assert device.reclaimable_bytes == device.used_bytes - device.hot_bytes == 0    # ... and never ours to free


def test_a_reclaim_that_would_leave_less_than_one_sequence_of_the_context_is_refused_whole():
    # 20 pages, 14 of them reclaimable or free; the context takes 12: at most 8 may be granted
    pool = _pool(free=6, context_pages=12)
    got = plan_reclaim("t", ("prefixes", "park", "evict"), pool, _cands(), 9 * BB)
    assert isinstance(got, ReclaimRefused)
    assert got.available_bytes == 8 * BB and got.granted_bytes == 9 * BB
    assert f"context floor {12 * BB} (12 pages" in got.reason
    ok = plan_reclaim("t", ("prefixes", "park", "evict"), pool, _cands(), 8 * BB)
    assert isinstance(ok, ReclaimPlan) and ok.to_bytes == 12 * BB
