"""The serving scheduler's decisions, on states folded from real events. Pure: no model, no sockets."""
from __future__ import annotations

import pytest

from residency.control.fold import fold
from residency.control.scheduler import CostModel, PendingRequest, Scheduler, SchedulerConfig
from residency.control.scheduler.core import Admit, Refuse, Wait
from residency.control.scheduler.prefix import num_matching_pages, pages_needed
from residency.control.state import State
from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded

P = 4            # tokens per page, small so the arithmetic is visible
BB = 1000        # bytes per page


class Ledger:
    def __init__(self, device_pages: int = 20, host_pages: int = 50):
        self.state = State()
        self.seq = 0
        self.n_moves = 0
        self.add(ev.WorkerJoined(worker=0, device="cpu", block_bytes=BB,
                                 tiers={"device": device_pages * BB, "host": host_pages * BB, "disk": 10**9}))

    def add(self, event):
        self.seq += 1
        env = Envelope(producer="test", epoch=1, producer_seq=self.seq, ts_ns=self.seq, seq=self.seq)
        fold(self.state, Recorded(env, event))
        return event

    def commit(self, blocks, session=None, keys=None):
        self.add(ev.BlocksCommitted(worker=0, session=session, tier="device", blocks=list(blocks),
                                    keys=keys or [""] * len(blocks), bytes=len(blocks) * BB))

    def move(self, kind, src, dst, blocks, ack=True):
        self.n_moves += 1
        mid = f"m-{self.n_moves}"
        self.add(ev.MoveRequested(move_id=mid, kind=kind, worker=0, src=src, dst=dst, blocks=list(blocks),
                                  bytes_planned=len(blocks) * BB, keep_source=False, deadline_ns=10**18, reason="t"))
        if ack:
            self.add(ev.MoveAcked(move_id=mid, worker=0, bytes_moved=len(blocks) * BB, bytes_freed_src=len(blocks) * BB,
                                  checksum_ok=True, started_ns=0, finished_ns=1))
        return mid


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def sched(restore_policy="cost", **cost) -> Scheduler:
    return Scheduler(SchedulerConfig(page_tokens=P, max_context=64, restore_policy=restore_policy),
                     CostModel(**cost) if cost else CostModel())


def pending(rid="r1", session=None, prompt=10, prompt_keys=None, max_tokens=6) -> PendingRequest:
    return PendingRequest(request_id=rid, session=session, worker=0, prompt_tokens=prompt,
                          prompt_keys=prompt_keys if prompt_keys is not None else keys("k", prompt // P),
                          max_tokens=max_tokens)


def run_turn(s: Scheduler, led: Ledger, a: PendingRequest, completion: int) -> Admit:
    """Admit, start, 'write' every new page the turn reaches, finish normally."""
    adm = s.plan(led.state, a)
    assert isinstance(adm, Admit), adm
    s.start(adm, now_ns=1)
    total = a.prompt_tokens + completion - 1
    written = adm.new_blocks[:-(-total // P) - len(adm.reused)]
    ks = (a.prompt_keys + [f"g{i}" for i in range(100)])[len(adm.reused):len(adm.reused) + len(written)]
    ks[-1] = "" if total % P else ks[-1]
    led.commit(written, a.session, ks)
    s.written(a.request_id, written, ks)
    s.finish(a.request_id, "stop", total, now_ns=2)
    return adm


# ------------------------------------------------------------------ prefix arithmetic
def test_pages_needed_counts_every_fed_position():
    assert pages_needed(10, 1, 4) == 3          # 10 prompt positions, the one sampled token is never fed
    assert pages_needed(10, 3, 4) == 3          # 12 positions
    assert pages_needed(10, 4, 4) == 4          # 13 positions


def test_a_fully_cached_prompt_still_computes_its_last_token():
    assert num_matching_pages(["a", "b", "c"], ["a", "b", "c"], 12, 4) == 2
    assert num_matching_pages(["a", "b", "c"], ["a", "b", "c"], 13, 4) == 3
    assert num_matching_pages(["a", "x", "c"], ["a", "b", "c"], 13, 4) == 1
    assert num_matching_pages(["a", ""], ["a", "b"], 13, 4) == 1, "a partial page never matches"


# ------------------------------------------------------------------ admission
def test_a_new_request_gets_fresh_pages_for_prompt_and_completion():
    led, s = Ledger(), sched()
    adm = s.plan(led.state, pending(prompt=10, max_tokens=6))
    assert isinstance(adm, Admit)
    assert adm.num_cached_tokens == 0 and adm.reused == [] and len(adm.blocks) == pages_needed(10, 6, P) == 4


def test_page_ids_never_reuse_ids_the_ledger_knows():
    led, s = Ledger(), sched()
    led.commit([0, 1, 7])
    adm = s.plan(led.state, pending())
    assert min(adm.blocks) == 8


def test_reservations_of_running_requests_count_against_the_device():
    led, s = Ledger(device_pages=10), sched()
    a1 = s.plan(led.state, pending("r1", prompt=12, max_tokens=9))     # 20 positions: 5 pages
    s.start(a1, 1)
    assert s.device_room(led.state, 0) == (10, 5)
    w = s.plan(led.state, pending("r2", prompt=12, max_tokens=13))     # 24 positions: 6 pages > 5 free
    assert isinstance(w, Wait) and (w.needed_blocks, w.free_blocks) == (6, 5)
    led.commit(a1.blocks[:2])                                       # committed pages move from reserved to used
    s.written("r1", a1.blocks[:2], ["", ""])
    assert s.device_room(led.state, 0) == (10, 5)


def test_a_request_larger_than_the_device_is_refused_with_the_numbers():
    led, s = Ledger(device_pages=3), sched()
    r = s.plan(led.state, pending(prompt=10, max_tokens=6))
    assert isinstance(r, Refuse) and r.status == 503 and r.code == "insufficient_kv_capacity"
    assert (r.needed_blocks, r.available_blocks) == (4, 3)


def test_waiting_for_room_names_the_idle_sessions_to_park_oldest_first():
    led, s = Ledger(device_pages=10), sched()
    run_turn(s, led, pending("a1", session="old", prompt=8, max_tokens=8), completion=8)    # 15 positions: 4 pages
    s.sessions["old"].last_used_ns = 5
    run_turn(s, led, pending("b1", session="new", prompt=8, prompt_keys=keys("n", 2), max_tokens=8), completion=8)
    s.sessions["new"].last_used_ns = 9
    w = s.plan(led.state, pending("c1", prompt=8, prompt_keys=keys("c", 2), max_tokens=8))   # 4 pages, 2 free
    assert isinstance(w, Wait) and w.park == ["old"]


def test_a_busy_session_is_refused_409():
    led, s = Ledger(), sched()
    a = s.plan(led.state, pending("r1", session="s"))
    s.start(a, 1)
    r = s.plan(led.state, pending("r2", session="s"))
    assert isinstance(r, Refuse) and r.status == 409 and r.code == "session_busy"


# ------------------------------------------------------------------ sessions and prefix reuse
def test_the_next_turn_reuses_the_matching_full_pages_and_drops_the_rest():
    led, s = Ledger(), sched()
    t1 = run_turn(s, led, pending("t1", session="s", prompt=10, prompt_keys=keys("k", 2), max_tokens=8), completion=5)
    entry = s.sessions["s"]
    assert entry.blocks == t1.blocks[:4] and entry.keys[:2] == ["k0", "k1"] and entry.num_tokens == 14
    # turn 2 shares the first two pages (the prompt of turn 1), then diverges
    t2 = s.plan(led.state, pending("t2", session="s", prompt=20, prompt_keys=["k0", "k1", "x2", "x3", "x4"], max_tokens=4))
    assert isinstance(t2, Admit)
    assert t2.reused == t1.blocks[:2] and t2.num_cached_tokens == 8 and t2.restore == {}
    assert t2.drop == {"device": t1.blocks[2:4]}
    assert t2.blocks[:2] == t1.blocks[:2] and len(t2.blocks) == pages_needed(20, 4, P)


def test_a_parked_prefix_is_restored_when_cheaper_than_recompute():
    led, s = Ledger(), sched(host_to_device_bytes_per_s=1e9, prefill_tokens_per_s=100, fixed_restore_s=0.001)
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", t1.blocks[:3])
    t2 = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    assert isinstance(t2, Admit) and t2.decision.choice == "restore"
    assert t2.restore == {"host": t1.blocks[:3]} and t2.restored_tokens == 12 == t2.num_cached_tokens
    assert s.decisions["restore"] == 1


def test_a_parked_prefix_is_recomputed_when_the_transfer_costs_more():
    led, s = Ledger(), sched(host_to_device_bytes_per_s=10.0, prefill_tokens_per_s=1e6)
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", t1.blocks[:3])
    t2 = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    assert isinstance(t2, Admit) and t2.decision.choice == "recompute"
    assert t2.reused == [] and t2.num_cached_tokens == 0 and t2.restore == {}
    assert t2.drop == {"host": t1.blocks[:3]}


def test_a_transfer_hidden_behind_the_prefill_of_new_tokens_is_priced_at_its_remainder():
    cost = CostModel(host_to_device_bytes_per_s=1000.0, prefill_tokens_per_s=100.0, fixed_restore_s=0.0)
    # 3000 bytes: 3 s of transfer; recomputing 100 cached tokens: 1 s
    assert cost.decide(cached_tokens=100, new_tokens=250, bytes_by_tier={"host": 3000}).choice == "recompute"
    cost.overlap = True   # ... but no worker has timed a prefill yet: nothing is priced as hidden
    assert cost.decide(cached_tokens=100, new_tokens=250, bytes_by_tier={"host": 3000}).hidden_s == 0
    cost.observe_prefill(100, 1.0)    # measured: 100 tokens/s
    # 250 new tokens take 2.5 s of prefill: only 0.5 s of the copy shows
    d = cost.decide(cached_tokens=100, new_tokens=250, bytes_by_tier={"host": 3000})
    assert d.choice == "restore" and d.restore_s == pytest.approx(0.5) and d.hidden_s == pytest.approx(2.5)


def test_restores_are_priced_hidden_only_when_every_serving_worker_overlaps_them():
    from residency.control.scheduler.workers import ServingWorkers
    from residency.events.commands import ServingReady

    class Link:
        def __init__(self, worker):
            self.worker = worker

    class Proc:
        state = None

        def allocate_block_ids(self, n):
            return list(range(n))

    cost = CostModel(host_to_device_bytes_per_s=1000.0, prefill_tokens_per_s=100.0, fixed_restore_s=0.0)
    cost.observe_prefill(100, 1.0)
    workers = ServingWorkers(Proc(), cost, restore_policy="cost", share_prefixes=False)
    workers.sched = Scheduler(SchedulerConfig(page_tokens=16, max_context=4096), cost)

    def ready(w, overlap):
        return ServingReady(worker=w, model="m", model_digest="d", max_context=4096, page_tokens=16, block_bytes=1,
                            device_blocks=8, eos_token_ids=[], restore_overlap=overlap)

    workers.on_ready(Link(0), ready(0, True))
    assert cost.overlap and cost.decide(cached_tokens=100, new_tokens=250, bytes_by_tier={"host": 3000}).hidden_s > 0
    workers.on_ready(Link(1), ready(1, False))
    assert not cost.overlap
    assert cost.decide(cached_tokens=100, new_tokens=250, bytes_by_tier={"host": 3000}).hidden_s == 0
    workers.lost(1)
    assert cost.overlap
    workers.lost(0)
    assert not cost.overlap


def test_disk_pages_cost_the_disk_read_and_the_copy_up():
    cost = CostModel(host_to_device_bytes_per_s=1000.0, disk_to_host_bytes_per_s=500.0, fixed_restore_s=0.0)
    assert cost.transfer_s({"disk": 1000}) == pytest.approx(3.0)
    assert cost.transfer_s({"host": 1000, "disk": 0}) == pytest.approx(1.0)


def test_a_disk_restore_hides_behind_the_prefill_only_up_to_its_slower_link_and_once_measured():
    cost = CostModel(host_to_device_bytes_per_s=1000.0, disk_to_host_bytes_per_s=500.0, prefill_tokens_per_s=100.0,
                     fixed_restore_s=0.0, overlap=True, smoothing=1.0)
    cost.observe_prefill(100, 1.0)                      # measured: 100 tokens/s
    # 1000 bytes from disk: 2 s of read + 1 s of copy up; 900 new tokens: 9 s of prefill
    assert cost.decide(cached_tokens=100, new_tokens=900, bytes_by_tier={"disk": 1000}).hidden_s == 0   # disk not timed
    cost.observe_transfer("disk", 1000, 2.0)            # a disk restore timed: 500 B/s
    d = cost.decide(cached_tokens=100, new_tokens=900, bytes_by_tier={"disk": 1000})
    assert d.transfer_s == pytest.approx(3.0) and d.hidden_s == pytest.approx(2.0)   # the slower link: the read
    assert d.restore_s == pytest.approx(1.0)            # the faster link's part always shows
    cost.observe_transfer("host", 1000, 4.0)            # now the copy up is the slower link (250 B/s)
    assert cost.decide(cached_tokens=100, new_tokens=900, bytes_by_tier={"disk": 1000}).hidden_s == pytest.approx(4.0)
    assert cost.decide(cached_tokens=100, new_tokens=150, bytes_by_tier={"disk": 1000}).hidden_s == pytest.approx(1.5)
    # pages from both tiers are two moves: a Generate awaits one, so nothing is priced as hidden
    assert cost.decide(cached_tokens=100, new_tokens=900, bytes_by_tier={"disk": 500, "host": 500}).hidden_s == 0


def test_measurements_move_the_cost_model():
    cost = CostModel(host_to_device_bytes_per_s=1e9, prefill_tokens_per_s=1000.0, smoothing=0.5)
    cost.observe_transfer("host", 4_000_000_000, 1.0)
    cost.observe_prefill(500, 0.25)
    cost.observe_prefill(3, 1.0)                # decode-sized: says nothing about prefill
    assert cost.bandwidth["host"] == pytest.approx(2.5e9) and cost.prefill_tokens_per_s == pytest.approx(1500.0)


def test_restore_policy_overrides_the_price():
    led, s = Ledger(), sched(restore_policy="restore", host_to_device_bytes_per_s=1.0)
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", t1.blocks[:3])
    t2 = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    assert t2.decision.choice == "restore" and "restore_policy=restore" in t2.decision.reason


def test_a_session_with_a_move_in_flight_waits_for_its_outcome():
    led, s = Ledger(), sched()
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", t1.blocks[:3], ack=False)
    w = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    assert isinstance(w, Wait) and "in flight" in w.reason


def test_a_cancelled_turn_leaves_the_session_with_only_its_reused_prefix():
    led, s = Ledger(), sched()
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    t2 = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=8))
    s.start(t2, 3)
    s.written("t2", t2.new_blocks[:1], ["k3"])
    s.finish("t2", "cancelled", 0, 4)
    e = s.sessions["s"]
    assert e.blocks == t1.blocks[:3] and e.keys == ["k0", "k1", "k2"] and e.busy is None


def test_a_failed_restore_recomputes_with_fresh_pages():
    led, s = Ledger(), sched(restore_policy="restore")
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", t1.blocks[:3])
    t2 = s.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    s.start(t2, 3)
    again = s.recompute_instead(led.state, "t2")
    assert again.num_cached_tokens == 0 and not set(again.blocks) & set(t1.blocks)
    assert len(again.blocks) == len(t2.blocks) and again.drop == {"host": t1.blocks[:3]}


def test_sessions_are_rebuilt_from_the_ledger_after_a_restart():
    led, s = Ledger(), sched()
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=3)
    fresh = sched()
    fresh.rebuild(led.state)
    e = fresh.sessions["s"]
    assert e.blocks == s.sessions["s"].blocks and e.keys[:3] == ["k0", "k1", "k2"]
    t2 = fresh.plan(led.state, pending("t2", session="s", prompt=16, prompt_keys=keys("k", 4), max_tokens=4))
    assert t2.reused == t1.blocks[:3]


def test_sessions_that_hold_nothing_are_forgotten_after_a_while():
    led, s = Ledger(), sched()
    t1 = run_turn(s, led, pending("t1", session="s", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    run_turn(s, led, pending("t2", session="kept", prompt=8, prompt_keys=keys("q", 2), max_tokens=4), completion=1)
    assert s.prune(led.state, now_ns=10**12, idle_ns=10) == []
    led.add(ev.BlocksFreed(worker=0, tier="device", blocks=t1.blocks[:3], bytes=3 * BB, reason="t"))
    led.state.check_integrity()
    assert s.prune(led.state, now_ns=10**12, idle_ns=10) == ["s"] and set(s.sessions) == {"kept"}


def test_a_worker_running_as_many_sequences_as_it_batches_makes_the_next_wait():
    led, s = Ledger(device_pages=40), sched()
    s.set_max_seqs(0, 2)
    for rid in ("a", "b"):
        adm = s.plan(led.state, pending(rid))
        assert isinstance(adm, Admit)
        s.start(adm, now_ns=1)
    w = s.plan(led.state, pending("c"))
    assert isinstance(w, Wait) and w.code == "server_overloaded" and w.park == []
    assert w.reason == "worker 0 is running 2 sequences, the most it batches"
    s.finish("a", "stop", 10, now_ns=2)
    assert isinstance(s.plan(led.state, pending("c")), Admit)
    s.set_max_seqs(0, 0)                  # a worker that does not say: no limit kept
    for rid in ("d", "e", "f"):
        adm = s.plan(led.state, pending(rid))
        assert isinstance(adm, Admit)
        s.start(adm, now_ns=3)


# ------------------------------------------------------------------ prefixes shared across sessions
def test_a_new_session_copies_another_sessions_resident_prefix_into_its_own_pages():
    led, s = Ledger(), sched()
    a = run_turn(s, led, pending("a1", session="a", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    b = s.plan(led.state, pending("b1", session="b", prompt=14, prompt_keys=["k0", "k1", "x2"], max_tokens=4))
    assert isinstance(b, Admit) and b.shared_from == "a" and b.shared == a.blocks[:2] and b.copied
    assert b.num_cached_tokens == 8 and b.reused == [] and b.restore == {}
    # its own pages: the copies first, then the rest of the sequence (17 positions: 5 pages)
    assert b.blocks == b.new_blocks and len(b.blocks) == pages_needed(14, 4, P) == 5
    assert not set(b.blocks) & set(a.blocks)
    s.start(b, 3)
    assert set(a.blocks[:2]) <= s.busy_blocks()[0], "the pages it copies are held while it runs"
    assert s.sessions["b"].blocks == [] and s.decisions["shared"] == 1


def test_a_request_outside_a_session_reads_the_shared_pages_in_place():
    led, s = Ledger(), sched()
    a = run_turn(s, led, pending("a1", session="a", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    r = s.plan(led.state, pending("r1", prompt=14, prompt_keys=["k0", "k1", "x2"], max_tokens=4))
    assert isinstance(r, Admit) and not r.copied and r.shared == a.blocks[:2]
    assert r.blocks[:2] == a.blocks[:2] and len(r.new_blocks) == 3 and r.blocks[2:] == r.new_blocks
    limit, free = s.device_room(led.state, 0)
    s.start(r, 3)
    assert s.device_room(led.state, 0) == (limit, free - 3), "shared pages take no new room"


def test_pages_in_a_move_are_not_shared_and_parked_ones_are_restored_first_or_recomputed():
    led = Ledger()
    s = sched(host_to_device_bytes_per_s=1e9, prefill_tokens_per_s=100, fixed_restore_s=0.001)
    a = run_turn(s, led, pending("a1", session="a", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    b_ask = pending("b1", prompt=14, prompt_keys=["k0", "k1", "x2"], max_tokens=4)
    mid = led.move("spill", "device", "host", a.blocks[1:2], ack=False)
    assert s.plan(led.state, b_ask).shared == a.blocks[:1], "a page in a move is not offered"
    led.add(ev.MoveAcked(move_id=mid, worker=0, bytes_moved=BB, bytes_freed_src=0, checksum_ok=True,
                         started_ns=0, finished_ns=1))
    assert s.plan(led.state, b_ask).restore == {"host": a.blocks[1:2]}, "moved off the device: restored first"
    led.move("park", "device", "host", a.blocks[:1])
    parked = s.plan(led.state, b_ask)
    assert parked.shared == a.blocks[:2] and parked.shared_from == "a" and parked.restore == {"host": a.blocks[:2]}
    assert parked.decision.choice == "restore" and parked.restored_tokens == 2 * P == parked.num_cached_tokens
    never = Scheduler(SchedulerConfig(page_tokens=P, max_context=64, restore_policy="recompute"))
    never.sessions = s.sessions
    r = never.plan(led.state, b_ask)
    assert r.shared == [] and r.restore == {} and r.decision.choice == "recompute"
    off = Scheduler(SchedulerConfig(page_tokens=P, max_context=64, share_prefixes=False))
    off.sessions = s.sessions
    assert off.plan(led.state, b_ask).shared == []


def test_a_failed_restore_of_a_shared_prefix_recomputes_and_leaves_the_donor_its_pages():
    led, s = Ledger(), sched(restore_policy="restore")
    a = run_turn(s, led, pending("a1", session="a", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    led.move("park", "device", "host", a.blocks[:3])
    for session, copied in ((None, False), ("b", True)):
        r = s.plan(led.state, pending(f"r-{copied}", session=session, prompt=14, prompt_keys=["k0", "k1", "x2"],
                                  max_tokens=4))
        assert r.copied is copied and r.shared == a.blocks[:2] and r.restore == {"host": a.blocks[:2]}
        s.start(r, 3)
        again = s.recompute_instead(led.state, r.request_id)
        assert again.drop == {} and again.num_cached_tokens == 0 and again.shared == []
        assert len(again.blocks) == len(r.blocks) and not set(again.blocks) & set(a.blocks)
        assert not set(a.blocks) & s.busy_blocks().get(0, set())
        s.finish(r.request_id, "stop", 17, 4)


def test_the_donor_waits_to_drop_pages_a_running_request_reads():
    led, s = Ledger(), sched()
    a = run_turn(s, led, pending("a1", session="a", prompt=12, prompt_keys=keys("k", 3), max_tokens=4), completion=1)
    r = s.plan(led.state, pending("r1", prompt=14, prompt_keys=["k0", "k1", "x2"], max_tokens=4))
    s.start(r, 3)
    # a's next turn diverges after its first page: its second page would be dropped while r reads it
    nxt = pending("a2", session="a", prompt=14, prompt_keys=["k0", "y1", "y2"], max_tokens=4)
    w = s.plan(led.state, nxt)
    assert isinstance(w, Wait) and f"pages [{a.blocks[1]}" in w.reason and "read by a running request" in w.reason
    s.finish("r1", "stop", 17, 4)
    adm = s.plan(led.state, nxt)
    assert isinstance(adm, Admit) and adm.reused == a.blocks[:1] and a.blocks[1] in adm.drop["device"]
