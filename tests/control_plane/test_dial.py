"""The dial's pure core (control/dial.py) on states folded from real events; the worker's
PoolRebound answers are made here (the edge of the unit)."""
from __future__ import annotations

import random

import pytest

from residency.control import dial
from residency.control.budget import Refusal
from residency.control.fold import fold
from residency.control.policy.recency import Recency
from residency.control.state import State, check_integrity, state_hash
from residency.events import catalog as ev
from residency.events.commands import PoolRebound
from residency.events.envelope import Envelope, Recorded

BB = 1000


class Ledger:
    def __init__(self, device_pages: int = 20, host_pages: int = 50):
        self.state = State()
        self.recency = Recency()
        self.events: list[Recorded] = []
        self.add(ev.WorkerJoined(worker=0, device="cpu", block_bytes=BB,
                                 tiers={"device": device_pages * BB, "host": host_pages * BB, "disk": 10**9}))

    def add(self, event):
        seq = len(self.events) + 1
        rec = Recorded(Envelope(producer="test", epoch=1, producer_seq=seq, ts_ns=seq * 1000, seq=seq), event)
        self.recency.observe(self.state, event, rec.envelope.ts_ns)
        fold(self.state, rec)
        self.events.append(rec)
        return event

    def commit(self, blocks, session=None):
        self.add(ev.BlocksCommitted(worker=0, session=session, tier="device", blocks=list(blocks),
                                    keys=[f"k{b}" for b in blocks], bytes=len(blocks) * BB))


def answer(req: ev.RebindRequested, *, stamps=None, error="", to_slots=10, measured=None) -> PoolRebound:
    readers = [r for r in req.readers if r != dial.SCHEDULER]
    return PoolRebound(rebind_id=req.rebind_id, worker=req.worker, tier="device", from_gen=req.from_gen,
                       to_gen=req.to_gen, from_slots=20, to_slots=to_slots, from_bytes=20 * BB, to_bytes=to_slots * BB,
                       stamps={r: req.to_gen for r in readers} if stamps is None else stamps,
                       measured_freed_bytes=measured, error=error)


def test_a_shrink_below_the_floor_is_refused_with_its_arithmetic():
    led = Ledger()
    led.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=3 * BB, ceiling_bytes=0))
    led.commit(range(6), session="s")
    got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", 7 * BB, in_use={0, 1, 2, 3, 100, 101})
    assert isinstance(got, Refusal)
    # floor = budget floor 3 pages + 4 pages in use on the device + 2 reserved (unwritten) = 9 pages
    assert got.floor_bytes == 9 * BB and got.asked_bytes == 7 * BB and got.available_bytes == 20 * BB
    assert "budget floor 3000" in got.reason and "4 pages held" in got.reason and "2 reserved" in got.reason


def test_a_shrink_at_the_floor_moves_the_coldest_idle_pages_out():
    led = Ledger()
    led.add(ev.BlocksCommitted(worker=0, session="old", tier="host", blocks=[0], keys=["k0"], bytes=BB))
    led.commit([0, 1, 2], session="old")
    led.commit([3, 4, 5], session="new")
    got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", 4 * BB + 999, in_use={5})
    assert isinstance(got, dial.ResizePlan)
    assert got.num_slots == 4 and got.to_bytes == 4 * BB and got.from_bytes == 20 * BB
    # 6 pages held, 4 slots: the two coldest idle ones leave; block 0 already has a host copy, so
    # only its device copy is freed (a release), block 1 is evicted to host
    by_kind = {(p.src, p.dst): sorted(p.blocks) for p in got.evict}
    assert by_kind == {("device", "host"): [1], ("device", "device"): [0]}


def test_a_grow_or_a_rebind_in_place_moves_nothing():
    led = Ledger()
    led.commit(range(5))
    for nbytes in (20 * BB, 40 * BB):
        got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", nbytes, in_use=set())
        assert isinstance(got, dial.ResizePlan) and got.evict == []


def test_a_shrink_below_one_sequence_of_the_whole_context_is_refused_with_its_arithmetic():
    led = Ledger()                               # 20 pages; the context takes ceil(50 / 4) = 13 of them
    ctx = dial.ContextFloor(max_context=50, page_tokens=4)
    got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", 12 * BB + 999, in_use=set(), context=ctx)
    assert isinstance(got, Refusal)
    assert (got.asked_bytes, got.floor_bytes, got.available_bytes) == (12 * BB, 13 * BB, 20 * BB)
    assert "context floor 13000 = ceil(max_context 50 / page_tokens 4) = 13 pages x 1000" in got.reason
    assert isinstance(dial.plan(led.state, led.recency, "operator:resize", 0, "device", 13 * BB, in_use=set(),
                                context=ctx), dial.ResizePlan)
    # a sleep's shrink passes no context: it may go down to one page
    assert isinstance(dial.plan(led.state, led.recency, "sleep", 0, "device", BB, in_use=set()), dial.ResizePlan)


def test_a_pool_already_below_the_context_floor_may_be_rebound_in_place_or_grown_never_shrunk():
    led = Ledger(device_pages=5)                 # started small (--device-blocks, or asleep)
    ctx = dial.ContextFloor(max_context=64, page_tokens=4)      # 16 pages
    for pages in (5, 9, 40):
        assert isinstance(dial.plan(led.state, led.recency, "operator:resize", 0, "device", pages * BB, in_use=set(),
                                    context=ctx), dial.ResizePlan)
    got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", 4 * BB, in_use=set(), context=ctx)
    assert isinstance(got, Refusal) and got.floor_bytes == 16 * BB and "context floor" in got.reason


@pytest.mark.parametrize("tier,nbytes,why", [("host", 10 * BB, "only the device pool"),
                                             ("device", BB - 1, "less than one block")])
def test_a_resize_that_names_nothing_resizable_is_invalid(tier, nbytes, why):
    led = Ledger()
    with pytest.raises(dial.InvalidResize, match=why):
        dial.validate(led.state, 0, tier, nbytes)
    with pytest.raises(dial.InvalidResize, match="not serving"):
        dial.validate(led.state, 7, "device", 10 * BB)


def test_a_rebind_commits_only_when_every_reader_stamps_and_the_pool_reopens():
    led = Ledger()
    req = led.add(dial.requested(led.state, "rb-1", 0, 0, [dial.SCHEDULER], ["serving", "mover"]))
    assert req.from_gen == 0 and req.to_gen == 1 and req.readers == ["scheduler", "serving", "mover"]
    assert dial.closed(led.state, 0)[0] == "pool_rebinding"
    for e in dial.worker_answer(req, answer(req, measured=10 * BB)):
        led.add(e)
    assert led.state.workers[0].tiers["device"].capacity_bytes == 10 * BB
    pr = [r.event for r in led.events if type(r.event) is ev.PoolResized][0]
    assert pr.measured_freed_bytes == 10 * BB and pr.gen == 1
    led.add(ev.ReaderStamped(rebind_id="rb-1", reader=dial.SCHEDULER, gen=1))
    v = dial.verdict(req, {"serving", "mover", "scheduler"})
    assert type(v) is ev.RebindCommitted
    led.add(v)
    assert dial.closed(led.state, 0) is None
    check_integrity(led.state)


def test_a_reader_that_misses_its_stamp_tears_the_pool_until_a_complete_rebind():
    led = Ledger()
    req = led.add(dial.requested(led.state, "rb-1", 0, 0, [dial.SCHEDULER], ["serving", "mover"]))
    got = dial.worker_answer(req, answer(req, stamps={"serving": 1}))
    assert [e.reader for e in got if type(e) is ev.ReaderStamped] == ["serving"]
    for e in got:
        led.add(e)
    v = dial.verdict(req, {"serving", "scheduler"})
    assert type(v) is ev.RebindTorn and v.readers_behind == ["mover"]
    led.add(v)
    code, why = dial.closed(led.state, 0)
    assert code == "pool_torn" and "rb-1" in why and "mover" in why
    assert dial.torn_pools(led.state) == [why]
    refused = dial.refuse_moves(led.state, [dial.Proposal(origin="operator:park", kind="park", worker=0, src="device",
                                                           dst="host", blocks=(1,), keep_source=False)])
    assert refused is not None and "rb-1" in refused.reason and refused.tier == "host"
    # a release still passes: a finished request's pages are never held by a torn pool
    assert dial.refuse_moves(led.state, [dial.Proposal(origin="x", kind="evict", worker=0, src="device", dst="device",
                                                        blocks=(1,), keep_source=True)]) is None
    # a rebind the worker refused changes nothing and does not repair it
    req2 = led.add(dial.requested(led.state, "rb-2", 0, 1, [dial.SCHEDULER], ["serving", "mover"]))
    assert req2.to_gen == 2
    for e in dial.worker_answer(req2, answer(req2, error="asked 10^12 bytes > 8 GiB free on the card")):
        assert type(e) is ev.RebindRefused
        led.add(e)
    assert dial.closed(led.state, 0)[0] == "pool_torn"
    req3 = led.add(dial.requested(led.state, "rb-3", 0, 1, [dial.SCHEDULER], ["serving", "mover"]))
    assert req3.to_gen == 3
    for e in dial.worker_answer(req3, answer(req3)):
        led.add(e)
    led.add(ev.ReaderStamped(rebind_id="rb-3", reader=dial.SCHEDULER, gen=3))
    led.add(dial.verdict(req3, {"serving", "mover", "scheduler"}))
    assert dial.closed(led.state, 0) is None and dial.torn_pools(led.state) == []
    check_integrity(led.state)
    replayed = State()
    for r in led.events:
        fold(replayed, r)
    assert state_hash(replayed) == state_hash(led.state)


def test_an_unanswered_rebind_is_torn_naming_every_reader_and_again_at_recovery():
    led = Ledger()
    req = led.add(dial.requested(led.state, "rb-1", 0, 0, [dial.SCHEDULER], ["serving"]))
    assert [e.readers_behind for e in dial.torn_at_recovery(led.state)] == [["scheduler", "serving"]]
    assert dial.unanswered(req).readers_behind == ["scheduler", "serving"]


def test_a_new_incarnation_of_the_worker_has_a_new_pool_not_the_torn_one():
    led = Ledger()
    req = led.add(dial.requested(led.state, "rb-1", 0, 0, [dial.SCHEDULER], ["serving"]))
    led.add(dial.unanswered(req))
    assert dial.closed(led.state, 0)[0] == "pool_torn"
    led.add(ev.WorkerLost(worker=0, reason="killed", bytes_lost=0))
    led.add(ev.WorkerJoined(worker=0, device="cpu", block_bytes=BB, tiers={"device": 20 * BB, "host": 50 * BB}))
    assert dial.closed(led.state, 0) is None


def test_the_plan_evicts_exactly_what_does_not_fit_on_random_states():
    rng = random.Random(20261206)
    for _ in range(50):
        led = Ledger(device_pages=40, host_pages=200)
        n = rng.randint(1, 40)
        led.commit(range(n), session="s")
        in_use = set(rng.sample(range(n), rng.randint(0, n)))
        slots = rng.randint(1, 45)
        got = dial.plan(led.state, led.recency, "operator:resize", 0, "device", slots * BB, in_use)
        if slots < len(in_use):
            assert isinstance(got, Refusal) and got.floor_bytes == len(in_use) * BB
            continue
        out = [b for p in got.evict for b in p.blocks]
        assert len(out) == max(0, n - slots) and not set(out) & in_use


def test_the_scheduler_places_nothing_on_a_rebinding_or_torn_pool():
    from residency.control.scheduler import PendingRequest, Scheduler, SchedulerConfig
    from residency.control.scheduler.core import Admit, Wait

    led = Ledger()
    sched = Scheduler(SchedulerConfig(page_tokens=4, max_context=64))
    req = PendingRequest(request_id="r1", session=None, worker=0, prompt_tokens=8, prompt_keys=["a", "b"],
                         max_tokens=4)
    assert isinstance(sched.plan(led.state, req), Admit)
    rb = led.add(dial.requested(led.state, "rb-1", 0, 0, [dial.SCHEDULER], ["serving"]))
    got = sched.plan(led.state, req)
    assert isinstance(got, Wait) and got.code == "pool_rebinding" and "rb-1" in got.reason
    led.add(dial.unanswered(rb))
    got = sched.plan(led.state, req)
    assert isinstance(got, Wait) and got.code == "pool_torn" and "rb-1" in got.reason


def test_a_group_rebind_commits_on_every_rank_or_is_torn_on_every_rank_that_resized():
    """The verdicts of one resize of three ranks' pools (control/dial.py verdicts): all or torn."""
    led = Ledger()
    for w in (1, 2):
        led.add(ev.WorkerJoined(worker=w, device="cpu", block_bytes=BB, group="tp0", rank=w,
                                tiers={"device": 20 * BB, "host": 50 * BB, "disk": 10**9}))
    readers = ["serving", "mover"]

    def start(n: int) -> list[ev.RebindRequested]:
        return [led.add(dial.requested(led.state, dial.rank_rebind_id(f"rb-{n}", k, 3), w, n - 1,
                                       [dial.SCHEDULER], readers)) for k, w in enumerate((0, 1, 2))]

    everyone = {dial.SCHEDULER, *readers}
    # every rank stamped every reader: committed on every rank
    reqs = start(1)
    assert [r.rebind_id for r in reqs] == ["rb-1.r0", "rb-1.r1", "rb-1.r2"]
    got = dial.verdicts(reqs, {r.rebind_id: set(everyone) for r in reqs})
    assert [(type(e), e.rebind_id) for e in got] == [(ev.RebindCommitted, r.rebind_id) for r in reqs]
    for e in got:
        led.add(e)
    assert [dial.closed(led.state, w) for w in (0, 1, 2)] == [None, None, None]
    # rank 1 missed one stamp: every rank's rebind is torn, each naming what is behind
    reqs = start(2)
    got = dial.verdicts(reqs, {reqs[0].rebind_id: set(everyone), reqs[1].rebind_id: everyone - {"mover"},
                               reqs[2].rebind_id: set(everyone)})
    assert [type(e) for e in got] == [ev.RebindTorn] * 3
    assert [e.readers_behind for e in got] == [["worker 1: mover"], ["mover"], ["worker 1: mover"]]
    for e in got:
        led.add(e)
    assert all(dial.closed(led.state, w)[0] == "pool_torn" for w in (0, 1, 2))
    # rank 2 refused while the others resized, rank 1 never answered: the others are torn, the
    # refusal changed nothing on rank 2 (its RebindRefused is recorded with its answer)
    reqs = start(3)
    got = dial.verdicts(reqs, {reqs[0].rebind_id: set(everyone), reqs[2].rebind_id: "no room"})
    assert [(e.rebind_id, e.readers_behind) for e in got] == [
        ("rb-3.r0", ["worker 1: scheduler", "worker 1: serving", "worker 1: mover", "worker 2: refused"]),
        ("rb-3.r1", ["scheduler", "serving", "mover", "worker 2: refused"])]
    # every rank refused: nothing changed anywhere, nothing more to record
    reqs = start(4)
    assert dial.verdicts(reqs, {r.rebind_id: "no room" for r in reqs}) == []
    # a worker alone: the same rule is the single verdict
    solo = led.add(dial.requested(led.state, "rb-9", 0, 5, [dial.SCHEDULER], readers))
    assert dial.verdicts([solo], {"rb-9": set(everyone)}) == [ev.RebindCommitted(rebind_id="rb-9")]
    assert dial.verdicts([solo], {}) == [dial.unanswered(solo)]
    assert dial.verdicts([solo], {"rb-9": "refused"}) == []


def test_a_group_pool_is_held_while_any_rank_s_pool_is_torn():
    """The leader refused its rebind (its pool unchanged, open on its own books) while rank 1
    resized and tore: the group's pool takes no request and no move on any rank (Dial.holds)."""
    from residency.control.dialing import Dial

    led = Ledger()
    led.add(ev.WorkerJoined(worker=1, device="cpu", block_bytes=BB, group="tp0", rank=1,
                            tiers={"device": 20 * BB, "host": 50 * BB, "disk": 10**9}))
    reqs = [led.add(dial.requested(led.state, dial.rank_rebind_id("rb-1", k, 2), k, 0, [dial.SCHEDULER], ["serving"]))
            for k in (0, 1)]
    led.add(ev.RebindRefused(rebind_id=reqs[0].rebind_id, worker=0, error="no room"))
    for e in dial.verdicts(reqs, {reqs[0].rebind_id: "no room", reqs[1].rebind_id: {dial.SCHEDULER, "serving"}}):
        led.add(e)
    assert dial.closed(led.state, 0) is None and dial.closed(led.state, 1)[0] == "pool_torn"
    d = Dial.__new__(Dial)            # only what holds() reads: the state, the runs, the ranks
    d.state, d.runs, d.ranks_of = led.state, {}, lambda w: [0, 1]
    assert d.holds(0)[0] == d.holds(1)[0] == "pool_torn" and "rb-1.r1" in d.holds(0)[1]
    d.ranks_of = lambda w: []         # a worker alone is judged on its own pool
    assert d.holds(0) is None
