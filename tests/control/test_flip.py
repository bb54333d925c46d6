"""Flips of the weights arena, the pure steps (control/flip.py), their fold, the watchdog's
deadlines and the recovery after a control crash mid-flip: values in, values out."""
from __future__ import annotations

import random

import pytest

from residency.control import flip, watchdog
from residency.control.fold import fold_all
from residency.control.state import State, check_integrity, state_hash
from residency.events import catalog as ev
from residency.events.commands import WeightsSwapped
from residency.events.envelope import Envelope, Recorded

MiB = 1 << 20


class Ledger:
    def __init__(self):
        self.items: list[Recorded] = []

    def add(self, event) -> int:
        seq = len(self.items) + 1
        self.items.append(Recorded(Envelope(producer="t", epoch=1, producer_seq=seq, ts_ns=seq * 1000, seq=seq), event))
        return seq

    def state(self) -> State:
        return fold_all(State(), self.items)


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    return random.Random(seed)


def served(rng) -> tuple[Ledger, dict[str, int]]:
    """A worker serving model "a" with a second model "b" of another size; fresh sizes each run."""
    lg = Ledger()
    lg.add(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 64 * MiB, "host": 256 * MiB, "disk": 0},
                           block_bytes=MiB))
    models = {"a": rng.randrange(100, 900) * MiB + rng.randrange(4096), "b": rng.randrange(100, 900) * MiB + 17}
    lg.add(ev.WeightsLoaded(worker=0, arena="weights", model="a", bytes=models["a"]))
    return lg, models


def swapped(req: ev.FlipRequested, rng, **over) -> WeightsSwapped:
    fields = dict(flip_id=req.flip_id, worker=req.worker, action=req.action, from_model=req.from_model,
                  resident="" if req.action == "sleep" else (req.to_model or "a"), from_gen=req.to_gen - 1,
                  to_gen=req.to_gen, bytes_out=req.bytes_out, bytes_in=req.bytes_in, steps=rng.randrange(1, 50),
                  overlapped_steps=0, checksum_ok=True, stamps={"runner": req.to_gen, "graphs": req.to_gen},
                  started_ns=1000, finished_ns=1000 + rng.randrange(1, 10**9))
    fields.update(over)
    return WeightsSwapped(**fields)


def run_flip(lg: Ledger, plan: flip.FlipPlan, fid: str, rng, kv_pool_bytes: int | None = None,
             **answer) -> list[ev.Event]:
    """Record a flip as the control would: the write-ahead pair, the worker's answer, the router's
    stamp (read from the fold), the verdict."""
    req, rebind = flip.requested(lg.state(), plan, fid, from_gen=0, deadline_ns=10**18, kv_pool_bytes=kv_pool_bytes)
    lg.add(req)
    lg.add(rebind)
    at_stake = lg.state().arenas["0:weights"].inflight_bytes
    out = flip.worker_answer(req, swapped(req, rng, **answer), at_stake)
    for e in out:
        lg.add(e)
    if any(type(e) is ev.FlipCompleted for e in out):
        stamped = {flip.WORKER}
        if flip.router_at(lg.state(), req):
            lg.add(ev.ReaderStamped(rebind_id=fid, reader=flip.ROUTER, gen=req.to_gen))
            stamped.add(flip.ROUTER)
        v = flip.verdict(req, stamped)
        lg.add(v)
        out = [*out, v]
    return [req, rebind, *out]


def test_a_flip_is_written_ahead_and_completed_from_what_the_worker_measured(rng):
    lg, models = served(rng)
    plan = flip.check(lg.state(), 0, "flip", "b", 0, models)
    assert (plan.from_model, plan.to_model, plan.bytes_out, plan.bytes_in) == ("a", "b", models["a"], models["b"])
    events = run_flip(lg, plan, "fl-1", rng)
    assert [type(e).__name__ for e in events] == ["FlipRequested", "RebindRequested", "ReaderStamped",
                                                 "FlipCompleted", "RebindCommitted"]
    req, rebind = events[0], events[1]
    assert rebind.pool == "weights" and rebind.readers == [flip.ROUTER, flip.WORKER] and rebind.to_gen == req.to_gen
    state = lg.state()
    check_integrity(state)
    arena = state.arenas["0:weights"]
    assert (arena.model, arena.bytes, arena.gen, arena.flip_in_flight, arena.num_flips) == ("b", models["b"],
                                                                                           req.to_gen, None, 1)
    assert state.rebinds["fl-1"].status == "committed"
    assert flip.resident(state, 0) == "b" and flip.closed(state, 0) is None
    # the next flip's generation is above every one the arena has had
    back = flip.requested(state, flip.check(state, 0, "flip", "a", 0, models), "fl-2", from_gen=0, deadline_ns=0)[0]
    assert back.to_gen == req.to_gen + 1


def test_sleep_and_wake_fold_to_asleep_and_back_and_each_refuses_its_twin(rng):
    lg, models = served(rng)
    level = rng.choice((1, 2))
    plan = flip.check(lg.state(), 0, "sleep", "", level, models)
    assert plan.bytes_out == (models["a"] if level == 1 else 0) and plan.bytes_in == 0
    run_flip(lg, plan, "fl-s", rng)
    state = lg.state()
    arena = state.arenas["0:weights"]
    assert arena.asleep and arena.sleep_level == level and arena.model == "a"
    assert flip.closed(state, 0)[0] == "asleep" and flip.resident(state, 0) is None
    again = flip.check(state, 0, "sleep", "", 1, models)
    assert isinstance(again, flip.FlipRefused) and again.code == "already_asleep"
    refused = again.event("operator:sleep")
    assert refused.reason.startswith("already_asleep: ") and refused.worker == 0
    no_flip = flip.check(state, 0, "flip", "b", 0, models)
    assert isinstance(no_flip, flip.FlipRefused) and no_flip.code == "asleep"
    wake = flip.check(state, 0, "wake", "", 0, models)
    assert (wake.to_model, wake.bytes_in) == ("a", models["a"])
    run_flip(lg, wake, "fl-w", rng)
    state = lg.state()
    assert not state.arenas["0:weights"].asleep and flip.resident(state, 0) == "a"
    awake = flip.check(state, 0, "wake", "", 0, models)
    assert isinstance(awake, flip.FlipRefused) and awake.code == "not_asleep"
    check_integrity(state)


def test_bad_asks_are_invalid_and_name_what_is_served(rng):
    lg, models = served(rng)
    state = lg.state()
    with pytest.raises(flip.UnknownModel, match="'a', 'b'"):
        flip.check(state, 0, "flip", "nope", 0, models)
    with pytest.raises(flip.InvalidFlip, match="level 3"):
        flip.check(state, 0, "sleep", "", 3, models)
    with pytest.raises(flip.InvalidFlip, match="worker 7"):
        flip.check(state, 7, "flip", "b", 0, models)
    with pytest.raises(flip.InvalidFlip, match="action"):
        flip.check(state, 0, "rotate", "b", 0, models)
    same = flip.check(state, 0, "flip", "a", 0, models)
    assert isinstance(same, flip.FlipRefused) and same.code == "already_resident"


def test_a_sleep_folds_the_kv_pool_size_its_wake_grows_back_to_until_the_pool_is_resized(rng):
    """The sleep's FlipRequested carries the pool's size before its shrink; the fold keeps it while
    asleep (a restarted control reads it there), and a later resize of the device pool (the wake's
    grow) clears it. A sleep that did not shrink the pool records None."""
    lg, models = served(rng)
    before = rng.randrange(2, 64) * MiB
    lg.add(ev.PoolResized(worker=0, pool="device", from_bytes=before, to_bytes=MiB, gen=1))
    sleep = flip.check(lg.state(), 0, "sleep", "", rng.choice((1, 2)), models)
    [req, *_] = run_flip(lg, sleep, "fl-s", rng, kv_pool_bytes=before)
    assert req.kv_pool_bytes == before
    state = lg.state()
    assert state.arenas["0:weights"].asleep and state.arenas["0:weights"].kv_pool_bytes == before
    cut = rng.randrange(1, len(lg.items))
    assert state_hash(fold_all(fold_all(State(), lg.items[:cut]), lg.items[cut:])) == state_hash(state)
    wake = flip.check(state, 0, "wake", "", 0, models)
    [wreq, *_] = run_flip(lg, wake, "fl-w", rng, kv_pool_bytes=rng.randrange(1, 1 << 30))
    assert wreq.kv_pool_bytes is None                       # only a sleep records it
    assert lg.state().arenas["0:weights"].kv_pool_bytes == before   # the wake's grow has not run yet
    lg.add(ev.PoolResized(worker=0, pool="device", from_bytes=MiB, to_bytes=before, gen=2))
    assert lg.state().arenas["0:weights"].kv_pool_bytes is None
    again = flip.check(lg.state(), 0, "sleep", "", 1, models)
    run_flip(lg, again, "fl-s2", rng)                       # a sleep whose shrink the dial refused
    assert lg.state().arenas["0:weights"].kv_pool_bytes is None
    check_integrity(lg.state())


def test_a_flip_while_one_runs_is_refused_naming_it(rng):
    lg, models = served(rng)
    req, rebind = flip.requested(lg.state(), flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-9", 0, 10**18)
    lg.add(req)
    lg.add(rebind)
    state = lg.state()
    for action, to in (("flip", "b"), ("sleep", ""), ("wake", "")):
        got = flip.check(state, 0, action, to, 1, models)
        assert isinstance(got, flip.FlipRefused) and got.code == "flip_in_progress" and "fl-9" in got.reason
    assert flip.closed(state, 0)[0] == "flip_in_progress"


def test_the_workers_error_is_recorded_verbatim_and_changes_nothing(rng):
    lg, models = served(rng)
    error = f"slab too small: needs {rng.randrange(10**9)} bytes, has {rng.randrange(10**6)}"
    events = run_flip(lg, flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-e", rng, error=error,
                      checksum_ok=False, stamps={})
    assert [type(e).__name__ for e in events[2:]] == ["FlipFailed", "RebindRefused"]
    assert events[2].error == error and not events[2].stranded
    state = lg.state()
    arena = state.arenas["0:weights"]
    assert (arena.model, arena.gen, arena.stranded, arena.flip_in_flight) == ("a", 0, None, None)
    assert flip.closed(state, 0) is None and state.rebinds["fl-e"].status == "refused"


@pytest.mark.parametrize("answer", [dict(checksum_ok=False), dict(stamps={"runner": 0}),
                                    dict(refused={"graphs": "capture failed"})])
def test_a_swap_that_did_not_verify_strands_the_arena_until_a_complete_flip(rng, answer):
    lg, models = served(rng)
    events = run_flip(lg, flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-x", rng, **answer)
    failed = events[2]
    assert type(failed) is ev.FlipFailed and failed.stranded and failed.stranded_bytes == max(models.values())
    assert type(events[3]) is ev.RebindTorn
    state = lg.state()
    assert flip.closed(state, 0)[0] == "weights_stranded" and "fl-x" in flip.stranded_arenas(state)[0]
    assert isinstance(flip.check(state, 0, "sleep", "", 1, models), flip.FlipRefused)
    run_flip(lg, flip.check(state, 0, "flip", "b", 0, models), "fl-fix", rng)      # the repair
    state = lg.state()
    assert flip.closed(state, 0) is None and flip.stranded_arenas(state) == []
    check_integrity(state)


def test_the_watchdog_strands_a_flip_past_its_deadline_or_whose_worker_went(rng):
    lg, models = served(rng)
    deadline = rng.randrange(10**12, 10**15)
    req, rebind = flip.requested(lg.state(), flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-d", 0, deadline)
    lg.add(req)
    lg.add(rebind)
    assert watchdog.overdue_flips(lg.state(), deadline) == []
    [(fid, why)] = watchdog.overdue_flips(lg.state(), deadline + 1)
    assert fid == "fl-d" and "deadline" in why
    lg.add(ev.WorkerLost(worker=0, reason="exited"))
    [(fid, why)] = watchdog.overdue_flips(lg.state(), 0)
    assert "lost" in why
    for e in flip.stranded(req, lg.state().arenas["0:weights"].inflight_bytes, why):
        lg.add(e)
    state = lg.state()
    arena = state.arenas["0:weights"]
    assert arena.stranded == "fl-d" and arena.stranded_bytes == max(models.values()) > 0
    assert watchdog.overdue_flips(state, 10**19) == [] and state.rebinds["fl-d"].status == "torn"
    check_integrity(state)


def test_after_a_control_crash_mid_flip_the_arena_is_stranded_and_a_new_incarnation_clears_it(rng):
    lg, models = served(rng)
    req, rebind = flip.requested(lg.state(), flip.check(lg.state(), 0, "sleep", "", 1, models), "fl-c", 0, 10**18)
    lg.add(req)
    lg.add(rebind)
    [failed] = flip.stranded_at_recovery(lg.state())
    assert failed.stranded and failed.flip_id == "fl-c" and failed.stranded_bytes == models["a"]
    lg.add(failed)
    state = lg.state()
    assert state.flips == {} and state.arenas["0:weights"].stranded == "fl-c"
    assert flip.stranded_at_recovery(state) == []
    # a worker that comes back as a new incarnation loads its own image: nothing stranded is left
    lg.add(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 64 * MiB, "host": 256 * MiB, "disk": 0},
                           block_bytes=MiB))
    lg.add(ev.WeightsLoaded(worker=0, arena="weights", model="a", bytes=models["a"]))
    assert flip.closed(lg.state(), 0) is None


def test_a_new_incarnation_mid_flip_drops_the_old_flip_from_the_books(rng):
    lg, models = served(rng)
    req, rebind = flip.requested(lg.state(), flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-n", 0, 10**18)
    lg.add(req)
    lg.add(rebind)
    lg.add(ev.WeightsLoaded(worker=0, arena="weights", model="a", bytes=models["a"]))
    state = lg.state()
    check_integrity(state)                  # no flip in flight names an arena that forgot it
    assert state.flips == {} and flip.stranded_at_recovery(state) == []


def test_replaying_the_flip_events_in_pieces_gives_the_same_state(rng):
    lg, models = served(rng)
    run_flip(lg, flip.check(lg.state(), 0, "flip", "b", 0, models), "fl-1", rng)
    run_flip(lg, flip.check(lg.state(), 0, "sleep", "", 2, models), "fl-2", rng)
    run_flip(lg, flip.check(lg.state(), 0, "wake", "", 0, models), "fl-3", rng)
    whole = fold_all(State(), lg.items)
    cut = rng.randrange(1, len(lg.items))
    parts = fold_all(fold_all(State(), lg.items[:cut]), lg.items[cut:])
    assert state_hash(whole) == state_hash(parts) and state_hash(whole).startswith("f7:")
    assert whole.arenas["0:weights"].num_flips == 3


def test_a_sleep_whose_pool_shrink_the_dial_refuses_completes_and_says_why(rng):
    """The dial's own plan refuses the one-block pool a sleep asks for (a budget floor): the refusal,
    recorded under the sleep's pool origin, is the answer's ``kv_pool`` with its arithmetic, and
    the sleep's outcome is still ``completed``; a shrink that ran adds its freed bytes to the sleep's."""
    from residency.control import dial
    from residency.control.api.flip_routes import outcome
    from residency.control.policy.recency import Recency

    lg, models = served(rng)
    floor = rng.randrange(2, 40) * MiB
    lg.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=floor, ceiling_bytes=0))
    state = lg.state()
    refusal = dial.plan(state, Recency(), "api:sleep:kv-pool", 0, "device", MiB, set())
    assert type(refusal).__name__ == "Refusal" and refusal.floor_bytes == floor
    refused = refusal.event(flip.kv_pool_origin("api:sleep"))
    lg.add(refused)
    plan = flip.check(lg.state(), 0, "sleep", "", rng.choice((1, 2)), models)
    events = [refused, *run_flip(lg, plan, "fl-s", rng)]
    [kv] = flip.kv_pool_outcome(events)
    assert (kv["worker"], kv["resized"], kv["asked_bytes"], kv["floor_bytes"]) == (0, False, MiB, floor)
    assert f"< floor {floor}" in kv["reason"]
    types = [type(e).__name__ for e in events if not flip.is_pool_refusal(e)]
    assert outcome(types, False) == ("completed", 200)
    # the sleep's own refusal (asleep already) is still a refusal
    twin = flip.check(lg.state(), 0, "sleep", "", 1, models).event("api:sleep")
    assert not flip.is_pool_refusal(twin) and outcome([type(twin).__name__], False)[0] == "refused"
    assert flip.freed_bytes(events) is None                     # nothing measured (a CPU host)
    freed = [rng.randrange(1, 1 << 30) for _ in range(2)]
    done = ev.FlipCompleted(flip_id="fl-x", bytes_out=1, bytes_in=0, started_ns=0, finished_ns=1, overlapped_steps=0,
                            checksum_ok=True, measured_freed_bytes=freed[0])
    shrunk = ev.PoolResized(worker=0, pool="device", from_bytes=64 * MiB, to_bytes=MiB, gen=1,
                            measured_freed_bytes=freed[1])
    assert flip.freed_bytes([shrunk, done]) == sum(freed)
    assert flip.kv_pool_outcome([shrunk])[0]["resized"] is True
