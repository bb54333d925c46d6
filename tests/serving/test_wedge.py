"""The wedge verdict alone (``WedgeWatch``): progress reported, requests running, time given."""
from __future__ import annotations

import random

import pytest

from residency.control.scheduler.wedge import WedgeWatch
from residency.events import catalog as ev

S = 1_000_000_000
MS = 1_000_000


@pytest.fixture
def rng():
    return random.Random()


def test_requests_running_and_a_still_step_counter_past_the_deadline_is_a_wedge_said_once(rng):
    w, step, t = rng.randrange(4), rng.randrange(1, 10**6), rng.randrange(10**12)
    watch = WedgeWatch(floor_s=2.0)
    watch.observe_pong(w, step, 1, 10, t)
    ids = [f"r-{rng.getrandbits(32):x}" for _ in range(rng.randrange(1, 4))]
    assert watch.check({w: ids}, t + 1 * S) == []
    watch.observe_pong(w, step, 1, 30, t + 1 * S)          # its I/O thread answers; the engine turns, no step
    [e] = watch.check({w: ids}, t + 2 * S + MS)
    assert type(e) is ev.WorkerWedged and e.worker == w and e.last_step == step
    assert e.running == len(ids) and e.request_ids == sorted(ids) and e.deadline_ms == 2000 and e.stalled_ms == 2001
    assert watch.is_wedged(w) and watch.wedged() == {w: e}
    assert watch.check({w: ids}, t + 9 * S) == []           # once per episode


def test_an_idle_worker_is_never_wedged_however_long_its_counter_stays(rng):
    t = rng.randrange(10**12)
    watch = WedgeWatch(floor_s=1.0)
    watch.observe_pong(0, 5, 0, 1, t)
    for k in range(1, 50):
        assert watch.check({}, t + k * S) == []
    # a request starts after the idle hour: its clock starts at the last check that saw none
    assert watch.check({0: ["a"]}, t + 49 * S + 900 * MS) == []
    assert [type(e) for e in watch.check({0: ["a"]}, t + 50 * S + 100 * MS)] == [ev.WorkerWedged]


def test_steps_keep_a_worker_unwedged_and_the_slowest_step_stretches_the_deadline(rng):
    t = rng.randrange(10**12)
    watch = WedgeWatch(floor_s=1.0, factor=4.0)
    slow = rng.randrange(400, 900) * MS
    watch.observe_step(0, 1, slow, t)
    assert watch.deadline_ns(0) == 4 * slow
    for k in range(2, 20):                       # a step every 0.9 s: never wedged
        watch.observe_step(0, k, 10 * MS, t + k * 900 * MS)
        assert watch.check({0: ["a"]}, t + k * 900 * MS + 899 * MS) == []
    last = t + 19 * 900 * MS
    assert watch.check({0: ["a"]}, last + 4 * slow - MS) == []
    assert [type(e) for e in watch.check({0: ["a"]}, last + 4 * slow + MS)] == [ev.WorkerWedged]


def test_a_pong_older_than_a_step_never_moves_the_counter_back(rng):
    t = rng.randrange(10**12)
    watch = WedgeWatch(floor_s=1.0)
    watch.observe_step(0, 7, MS, t)
    watch.observe_pong(0, 6, 1, 3, t + 800 * MS)     # sent before step 7, read after it
    assert watch.check({0: ["a"]}, t + 1100 * MS)    # 1.1 s since step 7: wedged


def test_a_wedged_worker_resumes_on_a_step_or_once_its_engine_turns_holding_nothing(rng):
    t = rng.randrange(10**12)
    watch = WedgeWatch(floor_s=1.0)
    for w in (0, 1, 2):
        watch.observe_pong(w, 3, 2, 100, t)
    wedged = watch.check({0: ["a"], 1: ["b"], 2: ["c"]}, t + 2 * S)
    assert sorted(e.worker for e in wedged) == [0, 1, 2]
    watch.observe_step(0, 4, MS, t + 3 * S)            # 0 steps again
    watch.observe_pong(1, 3, 0, 101, t + 3 * S)        # 1 let go of its sequences and turns
    watch.observe_pong(2, 3, 0, 100, t + 3 * S)        # 2 holds nothing but its engine has not turned: stuck
    resumed = watch.check({}, t + 4 * S)
    assert [(type(e), e.worker) for e in resumed] == [(ev.WorkerResumed, 0), (ev.WorkerResumed, 1)]
    assert resumed[0].step == 4 and resumed[0].wedged_ms == 2000
    assert watch.wedged().keys() == {2}
    watch.forget(2)                                     # lost: nothing more to say of it
    assert watch.wedged() == {} and watch.check({2: ["d"]}, t + 9 * S) == []


def test_a_worker_that_serves_no_model_is_not_watched(rng):
    watch = WedgeWatch(floor_s=1.0)
    watch.observe_pong(0, None, 0, 5, 0)
    assert watch.check({0: ["a"]}, 100 * S) == [] and not watch.is_wedged(0)
