"""The budget authority and the policies: pure functions of (state, recency, time, config)."""
from __future__ import annotations

import pytest

from residency.control import budget, moves
from residency.control.fold import fold
from residency.control.policy import PolicyConfig, RefusalMemo, plan
from residency.control.policy.proposals import busy_blocks
from residency.control.policy.recency import Recency
from residency.control.state import State
from residency.events import catalog as ev
from residency.events.asks import AskMove
from residency.events.envelope import Envelope, Recorded

BB = 1 << 20       # 1 MiB blocks
S = 1_000_000_000


class Book:
    """Events folded into a state (and a recency) at times the test chooses."""

    def __init__(self, device=10, host=20, disk=40):
        self.state, self.recency, self.seq = State(copies={}), Recency(), 0     # with the copy index, as the control
        self.add(ev.WorkerJoined(worker=0, device="cpu", block_bytes=BB,
                                 tiers={"device": device * BB, "host": host * BB, "disk": disk * BB}), 0)

    def add(self, e, t_s: float = 0.0):
        self.seq += 1
        ts = int(t_s * S)
        self.recency.observe(self.state, e, ts)
        fold(self.state, Recorded(Envelope(producer="t", epoch=1, producer_seq=self.seq, ts_ns=ts, seq=self.seq), e))

    def commit(self, blocks, t_s, session="s", tier="device"):
        self.add(ev.BlocksCommitted(worker=0, session=session, tier=tier, blocks=list(blocks), keys=[""] * len(blocks),
                                    bytes=len(blocks) * BB), t_s)

    def move(self, mid, kind, src, dst, blocks, t_s, keep=False, session=None, ack=True):
        self.add(ev.MoveRequested(move_id=mid, kind=kind, worker=0, src=src, dst=dst, blocks=list(blocks),
                                  bytes_planned=len(blocks) * BB, keep_source=keep, deadline_ns=10**19, reason="t",
                                  session=session), t_s)
        if ack:
            self.add(ev.MoveAcked(move_id=mid, worker=0, bytes_moved=len(blocks) * BB,
                                  bytes_freed_src=0 if keep else len(blocks) * BB, checksum_ok=True,
                                  started_ns=0, finished_ns=1), t_s)


# ---------------------------------------------------------------------- budget
def test_a_refusal_carries_its_arithmetic_and_changes_nothing():
    b = Book(device=10)
    b.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=2 * BB, ceiling_bytes=8 * BB))
    b.commit(range(5), 1)
    before = b.state.state_hash()
    r = budget.can_fund(b.state, 0, "device", 2 * BB)
    assert r is not None
    # ceiling 8 - floor 2 - used 5 = 1 block available
    assert (r.asked_bytes, r.available_bytes, r.floor_bytes, r.ceiling_bytes) == (2 * BB, BB, 2 * BB, 8 * BB)
    assert "available 1048576 = limit 8388608 - floor 2097152 - used 5242880" in r.reason
    assert b.state.state_hash() == before
    assert budget.can_fund(b.state, 0, "device", BB) is None


def test_in_flight_bytes_toward_a_tier_are_spent_budget():
    b = Book(device=10)
    b.commit(range(4), 1, tier="host")
    b.move("m1", "restore", "host", "device", [0, 1, 2], 2, ack=False)
    assert budget.available_bytes(b.state.tier(0, "device")) == 7 * BB
    assert budget.can_fund(b.state, 0, "device", 8 * BB) is not None


def test_a_ceiling_above_capacity_or_a_floor_above_the_ceiling_is_not_a_budget():
    b = Book(device=10)
    assert "ceiling" in budget.check_budget(b.state, 0, "device", 0, 11 * BB)
    assert "floor" in budget.check_budget(b.state, 0, "device", 9 * BB, 8 * BB)
    assert budget.check_budget(b.state, 0, "device", BB, 8 * BB) is None
    assert budget.check_budget(b.state, 3, "device", 0, 0) == "no worker 3"


def test_a_budget_refusal_names_its_sizes_in_human_units_and_exact_bytes():
    b = Book(device=10)
    cap = 10 * BB
    assert budget.check_budget(b.state, 0, "device", 0, 60 << 30) == (
        f"ceiling 60.0 GiB ({60 << 30} bytes) > capacity {cap / (1 << 20):.1f} MiB ({cap} bytes) of device on worker 0")


def test_an_ask_is_funded_whole_or_refused_whole_never_smaller():
    b = Book(device=4, host=20)
    b.commit(range(3), 1, tier="host", session="a")
    b.commit(range(3, 6), 1, tier="disk", session="a")
    asks = moves.resolve(b.state, AskMove(ask_id="x", kind="restore", worker=0, session="a"), "operator:restore")
    assert sorted((a.src, len(a.blocks)) for a in asks) == [("disk", 3), ("host", 3)]
    r = moves.fund(b.state, asks)
    # 6 blocks asked in total, 4 fit: refused with the total, not the part that would fit
    assert r is not None and r.asked_bytes == 6 * BB and r.available_bytes == 4 * BB


# ---------------------------------------------------------------------- pressure
def test_pressure_spills_the_coldest_blocks_above_high_watermark_down_to_low():
    b = Book(device=10, host=20)
    for i in range(10):
        b.commit([i], t_s=i)            # block i last used at i s
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.6, hot_s=1, cooldown_s=0, park=False)
    asks = plan(b.state, b.recency, 100 * S, cfg)
    assert len(asks) == 1
    a = asks[0]
    assert (a.kind, a.src, a.dst, a.keep_source) == ("evict", "device", "host", False)
    assert a.blocks == (0, 1, 2, 3)     # 10 used -> 6 = low watermark; the four coldest


def test_no_pressure_at_or_below_the_high_watermark_and_in_flight_evictions_count():
    b = Book(device=10, host=20)
    for i in range(9):
        b.commit([i], t_s=i)
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.6, hot_s=1, cooldown_s=0, park=False)
    assert plan(b.state, b.recency, 100 * S, cfg) == []
    b.commit([9], t_s=9)
    b.move("m1", "evict", "device", "host", [0, 1, 2, 3], 10, ack=False)   # relief already on its way
    assert plan(b.state, b.recency, 100 * S, cfg) == []


def test_hot_and_unknown_blocks_are_never_spilled():
    b = Book(device=10, host=20)
    b.commit(range(10), t_s=99.5)       # all used half a second ago
    cfg = PolicyConfig(high_watermark=0.5, low_watermark=0.4, hot_s=1, cooldown_s=0, park=False)
    assert plan(b.state, b.recency, 100 * S, cfg) == []
    # a state whose use times are unknown (a fresh recency): unknown counts as hot
    assert plan(b.state, Recency(), 100 * S, cfg) == []


def test_cooldown_keeps_just_restored_blocks_from_bouncing_back():
    b = Book(device=12, host=20)
    b.commit(range(6), t_s=0)
    b.move("out", "evict", "device", "host", [0, 1, 2, 3], 1)
    b.move("back", "restore", "host", "device", [0, 1, 2, 3], 50)      # restored (and used) at 50 s
    b.commit(range(6, 12), t_s=55)                                      # the device is full again
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.6, hot_s=1, cooldown_s=30, park=False)
    # by last use alone 4, 5 (0 s) then 0..3 (50 s) are the coldest; 0..3 just moved: they stay
    asks = plan(b.state, b.recency, 60 * S, cfg)
    assert asks and asks[0].blocks == (4, 5, 6, 7, 8)
    later = plan(b.state, b.recency, 81 * S, cfg)                       # cooled down: plain LRU again
    assert later[0].blocks == (4, 5, 0, 1, 2)


def test_pressure_releases_device_copies_that_already_have_a_host_copy():
    b = Book(device=10, host=20)
    b.commit(range(10), t_s=0)
    b.move("wt", "spill", "device", "host", [0, 1], 1, keep=True)     # write-through copies
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.7, hot_s=1, cooldown_s=0, park=False)
    asks = plan(b.state, b.recency, 100 * S, cfg)
    kinds = {(a.src, a.dst, a.blocks) for a in asks}
    assert ("device", "device", (0, 1)) in kinds               # a release: no copy needed
    assert ("device", "host", (2,)) in kinds


def test_host_pressure_demotes_to_disk():
    b = Book(device=10, host=4, disk=40)
    b.commit(range(4), t_s=0, tier="host")
    cfg = PolicyConfig(high_watermark=0.7, low_watermark=0.5, hot_s=1, cooldown_s=0, park=False)
    asks = plan(b.state, b.recency, 100 * S, cfg)
    assert [(a.kind, a.src, a.dst, len(a.blocks)) for a in asks] == [("demote", "host", "disk", 2)]


def test_busy_blocks_are_left_alone():
    b = Book(device=10, host=20)
    b.commit(range(10), t_s=0)
    b.move("stuck", "spill", "device", "host", [0, 1], 1, keep=True, ack=False)
    b.add(ev.MoveStranded(move_id="stuck", worker=0, bytes_at_risk=2 * BB, why="deadline"), 2)
    assert busy_blocks(b.state) == {0: {0, 1}}
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.6, hot_s=1, cooldown_s=0, park=False)
    assert not {0, 1} & set(plan(b.state, b.recency, 100 * S, cfg)[0].blocks)


# ---------------------------------------------------------------------- park
def test_an_idle_session_is_parked_whole_and_a_recent_one_is_not():
    b = Book(device=10, host=20)
    b.commit([0, 1, 2], t_s=0, session="idle")
    b.commit([3, 4], t_s=95, session="busy")
    cfg = PolicyConfig(pressure=False, park_idle_s=30)
    asks = plan(b.state, b.recency, 100 * S, cfg)
    assert [(a.kind, a.session, a.blocks, a.keep_source) for a in asks] == [("park", "idle", (0, 1, 2), False)]
    b.add(ev.RequestAdmitted(request_id="r", session="idle", prompt_tokens=3), 99)    # it speaks again
    assert plan(b.state, b.recency, 100 * S, cfg) == []


def test_pages_restored_for_the_last_turn_are_parked_with_the_rest_of_the_session():
    b = Book(device=10, host=20)
    b.commit([0, 1, 2, 3], t_s=0, session="s")
    b.move("p", "park", "device", "host", [0, 1, 2, 3], t_s=10, session="s")
    b.move("r", "restore", "host", "device", [0, 1], t_s=20, session="s")       # its next turn reuses two
    b.commit([4, 5], t_s=21, session="s")
    cfg = PolicyConfig(pressure=False, park_idle_s=5, cooldown_s=60)            # 0 and 1 are still cooling
    asks = plan(b.state, b.recency, 28 * S, cfg)
    assert [(a.kind, a.session, sorted(a.blocks)) for a in asks] == [("park", "s", [0, 1, 4, 5])]


def test_a_session_with_a_busy_device_page_is_not_parked_in_part():
    b = Book(device=10, host=20)
    b.commit([0, 1, 2], t_s=0, session="s")
    cfg = PolicyConfig(pressure=False, park_idle_s=5)
    assert plan(b.state, b.recency, 30 * S, cfg, busy={0: {1}}) == []
    assert [sorted(a.blocks) for a in plan(b.state, b.recency, 30 * S, cfg, busy={})] == [[0, 1, 2]]


def test_a_session_bigger_than_one_move_is_parked_whole_in_several_moves():
    b = Book(device=10, host=20)
    b.commit(range(7), t_s=0, session="s")
    cfg = PolicyConfig(pressure=False, park_idle_s=5, max_blocks_per_move=3)
    asks = plan(b.state, b.recency, 30 * S, cfg)
    assert all(len(a.blocks) <= 3 and a.kind == "park" for a in asks)
    assert sorted(x for a in asks for x in a.blocks) == list(range(7))


def test_a_refused_policy_ask_is_not_repeated_until_something_changed():
    b = Book(device=10, host=2)
    b.commit(range(10), t_s=0)
    cfg = PolicyConfig(high_watermark=0.9, low_watermark=0.6, hot_s=1, cooldown_s=0, park=False,
                       refusal_backoff_s=60)
    memo = RefusalMemo()
    ask = plan(b.state, b.recency, 100 * S, cfg, memo)[0]
    r = moves.fund(b.state, [ask])
    assert r is not None and r.asked_bytes == 4 * BB       # host holds 2: refused, not shrunk to 2
    memo.note(ask, r.available_bytes, 100 * S)
    assert plan(b.state, b.recency, 101 * S, cfg, memo) == []           # no refusal storm
    assert plan(b.state, b.recency, 161 * S, cfg, memo) != []           # after the backoff, asked again
    b.commit([100], t_s=102, tier="host")                               # host changed: asked again now
    assert plan(b.state, b.recency, 103 * S, cfg, memo) != []


def test_watermarks_must_be_ordered():
    with pytest.raises(ValueError):
        PolicyConfig(high_watermark=0.5, low_watermark=0.8)


class _RecencyRef:
    """The plain version of ``Recency``: one dict keyed by (worker, block), a Python step per block."""

    def __init__(self):
        self.used, self.moved, self.active = {}, {}, {}

    def observe(self, state, e, ts):
        t = type(e)
        if t is ev.BlocksCommitted:
            for b in e.blocks:
                self.used[(e.worker, b)] = ts
            if e.session is not None:
                self.active[e.session] = ts
        elif t in (ev.MoveAcked, ev.MoveLateAcked):
            mv = (state.inflight if t is ev.MoveAcked else state.stranded).get(e.move_id)
            if mv is None:
                return
            for b in mv.blocks:
                self.moved[(mv.worker, b)] = ts
                if mv.dst == "device" and mv.src != "device":
                    self.used[(mv.worker, b)] = ts
            if mv.dst == "device" and mv.session is not None:
                self.active[mv.session] = ts
        elif t in (ev.RequestAdmitted, ev.SessionRestored) and e.session is not None:
            self.active[e.session] = ts
        elif t is ev.WorkerLost:
            for d in (self.used, self.moved):
                for k in [k for k in d if k[0] == e.worker]:
                    del d[k]

    def prune(self, state):
        for d in (self.used, self.moved):
            for k in [k for k in d if k[1] not in state.blocks.get(k[0], ())]:
                del d[k]


def test_recency_answers_what_a_per_block_record_of_every_event_answers():
    import random
    rng = random.Random(3)
    for _ in range(40):
        b = Book(device=40, host=40, disk=40)
        b.add(ev.WorkerJoined(worker=1, device="cpu", block_bytes=BB, tiers={"device": 40 * BB, "host": 40 * BB,
                                                                             "disk": 40 * BB}))
        ref = _RecencyRef()
        state = b.state

        def add(e, t_s):
            ref.observe(state, e, int(t_s * S))
            b.add(e, t_s)
        for w in (0, 1):
            add(ev.BlocksCommitted(worker=w, session=f"s{w}", tier="device", blocks=list(range(12)), keys=[""] * 12,
                                   bytes=12 * BB), 1)
        for step in range(30):
            w, t_s = rng.choice((0, 1)), 2 + step
            on = {t: [i for i, st in state.blocks.get(w, {}).items() if t in st.tiers and len(st.tiers) == 1]
                  for t in ("device", "host")}
            src = rng.choice([t for t in on if on[t]] or ["device"])
            picked = rng.sample(on[src], min(len(on[src]), rng.randint(1, 4))) if on[src] else []
            if not picked:
                continue
            dst = "host" if src == "device" else "device"
            mid = f"m{step}"
            add(ev.MoveRequested(move_id=mid, kind="restore" if dst == "device" else "evict", worker=w, src=src,
                                 dst=dst, blocks=picked, bytes_planned=len(picked) * BB, keep_source=False,
                                 deadline_ns=10**19, reason="t", session=rng.choice([None, f"s{w}"])), t_s)
            done = rng.random()
            if done < 0.15:
                add(ev.MoveStranded(move_id=mid, worker=w, bytes_at_risk=len(picked) * BB, why="deadline"), t_s)
                add(ev.MoveLateAcked(move_id=mid, worker=w, bytes_moved=len(picked) * BB,
                                     bytes_freed_src=len(picked) * BB, checksum_ok=True, started_ns=0,
                                     finished_ns=1), t_s + 0.5)
            else:
                add(ev.MoveAcked(move_id=mid, worker=w, bytes_moved=len(picked) * BB, bytes_freed_src=len(picked) * BB,
                                 checksum_ok=True, started_ns=0, finished_ns=1), t_s)
            if rng.random() < 0.1:
                gone = rng.sample(sorted(state.blocks.get(w, {})), 2)
                for g in gone:
                    for tier in list(state.blocks[w][g].tiers):
                        add(ev.BlocksFreed(worker=w, tier=tier, blocks=[g], bytes=BB, reason="t"), t_s)
                b.recency.prune(state)
                ref.prune(state)
        if rng.random() < 0.5:
            add(ev.WorkerLost(worker=1, reason="t", blocks_lost=sorted(state.blocks.get(1, {})), bytes_lost=0), 40)
        now = 45 * S
        for w in (0, 1):
            for blk in range(12):
                for hot_ns in (5 * S, 30 * S, 60 * S):
                    used = ref.used.get((w, blk))
                    assert b.recency.is_hot(w, blk, now, hot_ns) == (used is None or now - used < hot_ns)
                    moved = ref.moved.get((w, blk))
                    assert b.recency.is_cooling(w, blk, now, hot_ns) == (moved is not None and now - moved < hot_ns)
                assert b.recency.last_used(w, blk) == ref.used.get((w, blk), 1 << 62)
        for s in ("s0", "s1", "none"):
            assert b.recency.idle_ns(s, now) == (None if s not in ref.active else now - ref.active[s])
