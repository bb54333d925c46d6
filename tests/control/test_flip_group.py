"""The verdict of a tensor-parallel group's flip (control/flip_group.py): every rank completed,
every rank refused, or torn (never a group whose ranks hold different models), folded into each
rank's arena. Values in, values out; fresh random sizes and answers each run."""
from __future__ import annotations

import random

import pytest

from residency.control import flip, flip_group
from residency.control.state import check_integrity
from residency.events import catalog as ev
from tests.control.test_flip import Ledger, MiB, swapped

RANKS = (0, 1, 2)


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    return random.Random(seed)


def group_flip(rng) -> tuple[Ledger, dict[int, ev.FlipRequested], dict[int, int]]:
    """Three ranks serving their shares of "a", a flip to "b" requested on each (write-ahead)."""
    lg = Ledger()
    share_a, share_b = rng.randrange(100, 900) * MiB + 3, rng.randrange(100, 900) * MiB + 5
    for w in RANKS:
        lg.add(ev.WorkerJoined(worker=w, device="cpu", tiers={"device": 64 * MiB, "host": 256 * MiB, "disk": 0},
                               block_bytes=MiB, group="tp0", rank=w))
        lg.add(ev.WeightsLoaded(worker=w, arena="weights", model="a", bytes=share_a))
    reqs, stakes = {}, {}
    for k, w in enumerate(RANKS):
        plan = flip.check(lg.state(), w, "flip", "b", 0, {"a": share_a, "b": share_b})
        req, rebind = flip.requested(lg.state(), plan, flip_group.rank_flip_id("fl-1-1", k, len(RANKS)), 0,
                                     deadline_ns=10**18)
        lg.add(req)
        lg.add(rebind)
        reqs[w] = req
        stakes[w] = lg.state().arenas[f"{w}:weights"].inflight_bytes
    return lg, reqs, stakes


def test_rank_flip_ids_name_the_rank_and_a_worker_alone_keeps_its_id():
    assert [flip_group.rank_flip_id("fl-9-4", k, 3) for k in range(3)] == ["fl-9-4.r0", "fl-9-4.r1", "fl-9-4.r2"]
    assert flip_group.rank_flip_id("fl-9-4", 0, 1) == "fl-9-4"


def test_every_rank_swapped_is_completed_and_every_rank_refused_changes_nothing(rng):
    _, reqs, _ = group_flip(rng)
    ok = {w: swapped(reqs[w], rng, resident="b") for w in RANKS}
    assert flip_group.outcome(reqs, ok) == "completed"
    no = {w: swapped(reqs[w], rng, error=f"refused {rng.random()}", checksum_ok=False, stamps={}) for w in RANKS}
    assert flip_group.outcome(reqs, no) == "refused"


@pytest.mark.parametrize("how", ["one_refused", "one_silent", "one_behind", "one_bad_checksum"])
def test_any_other_mix_is_torn_every_rank_that_may_have_moved_stranded_and_nothing_completed(rng, how):
    lg, reqs, stakes = group_flip(rng)
    odd = rng.choice(RANKS)
    answers = {w: swapped(reqs[w], rng, resident="b") for w in RANKS}
    if how == "one_refused":
        answers[odd] = swapped(reqs[odd], rng, error="no room", checksum_ok=False, stamps={})
    elif how == "one_silent":
        del answers[odd]
    elif how == "one_behind":
        answers[odd] = swapped(reqs[odd], rng, stamps={"runner": reqs[odd].to_gen, "graphs": reqs[odd].to_gen - 1})
    else:
        answers[odd] = swapped(reqs[odd], rng, checksum_ok=False)
    assert flip_group.outcome(reqs, answers) == "torn"
    events, why = flip_group.torn(reqs, answers, stakes, silent_why="deadline")
    assert "torn" in why and all(f"worker {w}:" in why for w in RANKS)
    assert not [e for e in events if type(e) is ev.FlipCompleted]
    for e in events:
        lg.add(e)
    state = lg.state()
    check_integrity(state)
    assert state.flips == {}
    for w in RANKS:
        arena = state.arenas[f"{w}:weights"]
        assert arena.model == "a" and arena.flip_in_flight is None
        refused = how == "one_refused" and w == odd
        assert bool(arena.stranded) is not refused, (w, arena)
        if not refused:
            assert arena.stranded_bytes == stakes[w]
    torn = {e.rebind_id: e for e in events if type(e) is ev.RebindTorn}
    for w, req in reqs.items():       # each torn rank names every peer's state after its own readers
        if req.flip_id in torn:
            behind = torn[req.flip_id].readers_behind
            assert behind[:2] == [flip.ROUTER, flip.WORKER]
            assert sorted(int(p.split()[1].rstrip(":")) for p in behind[2:]) == [p for p in RANKS if p != w]
