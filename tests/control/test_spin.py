"""control/spin.py: when the control loop polls awake for an ack, and when it sleeps."""
from __future__ import annotations

from control.spin import MAX_TRACKED, MS, AckSpin

ROUTE = (0, "device", "host")


def test_no_rate_learned_no_prediction_and_the_timeout_is_untouched():
    s = AckSpin(1.0, 3.0)
    s.dispatched("m-1", ROUTE, 1 << 30, 0)
    assert s.spin_at is None and s.timeout_ms(0, 50) == 50


def test_the_window_opens_before_the_predicted_end_and_closes_after_it():
    s = AckSpin(1.0, 3.0)
    s.learned(ROUTE, 40_000_000, 40 * MS)           # 1 byte per ns
    s.dispatched("m-1", ROUTE, 40_000_000, 100 * MS)  # predicted end: 140 ms
    assert s.spin_at == 140 * MS
    assert s.timeout_ms(100 * MS, 50) == 39          # sleep, waking at the window's start (139 ms)
    assert s.timeout_ms(int(138.5 * MS), 50) == 1    # rounded up, never early into a sleep past it
    assert s.timeout_ms(139 * MS, 50) == 0           # in the window
    assert s.timeout_ms(143 * MS, 50) == 0
    assert s.timeout_ms(int(143.1 * MS), 50) == 50   # past it: the late ack is waited for asleep
    assert s.spin_at is None and s.expected == {}
    assert s.num_spins == 2


def test_the_earliest_of_several_moves_leads_and_a_settled_one_stops_counting():
    s = AckSpin(1.0, 3.0)
    s.learned(ROUTE, 10, 10)
    s.learned((0, "host", "device"), 10, 20)        # half the rate
    s.dispatched("slow", (0, "host", "device"), 10 * MS, 0)   # ends at 20 ms
    s.dispatched("fast", ROUTE, 10 * MS, 0)                   # ends at 10 ms
    assert s.spin_at == 10 * MS
    s.settled("fast")
    assert s.spin_at == 20 * MS
    s.settled("slow")
    assert s.spin_at is None and s.timeout_ms(0, 7) == 7


def test_rates_follow_the_acks_and_bad_measurements_are_ignored():
    s = AckSpin(1.0, 3.0)
    s.learned(ROUTE, 100, 100)
    s.learned(ROUTE, 300, 100)
    assert s.rates[ROUTE] == 2.0                     # half the old, half the new
    s.learned(ROUTE, 0, 100)
    s.learned(ROUTE, 100, 0)
    assert s.rates[ROUTE] == 2.0


def test_off_means_off_and_tracking_is_bounded():
    off = AckSpin(0.0, 0.0)
    off.learned(ROUTE, 10, 10)
    off.dispatched("m", ROUTE, 10, 0)
    assert not off.enabled and off.spin_at is None and off.timeout_ms(0, 50) == 50
    s = AckSpin(1.0, 3.0)
    s.learned(ROUTE, 1, 1)
    for i in range(MAX_TRACKED + 10):
        s.dispatched(f"m-{i}", ROUTE, 10**9, 0)
    assert len(s.expected) == MAX_TRACKED


def test_while_spinning_the_move_predicted_first_is_named_for_warming_at_most_every_quarter_ms():
    from control.spin import WARM_EVERY_NS
    s = AckSpin(1.0, 3.0)
    s.learned(ROUTE, 1, 1)
    s.dispatched("late", ROUTE, 20 * MS, 0)
    s.dispatched("early", ROUTE, 10 * MS, 0)
    assert s.warm_move(8 * MS) is None                    # before the window: nothing to read yet
    assert s.warm_move(9 * MS) == "early"
    assert s.warm_move(9 * MS + WARM_EVERY_NS - 1) is None
    assert s.warm_move(9 * MS + WARM_EVERY_NS) == "early"
    s.settled("early")
    assert s.warm_move(19 * MS) == "late"


def test_warming_a_move_reads_its_blocks_and_changes_nothing():
    import copy

    from control.moves import warm
    from control.state import BlockState, MoveState, State, state_hash
    st = State()
    st.blocks[0] = {b: BlockState(session="s", key="", tiers=["device"]) for b in range(8)}
    st.inflight["m-1"] = MoveState("m-1", "evict", 0, "device", "host", [1, 3, 5, 99], 4, False, 0, "s", 1)
    before = copy.deepcopy(st)
    assert warm(st, "m-1") == 3                            # block 99 is gone: skipped
    assert warm(st, "m-unknown") == 0
    assert state_hash(st) == state_hash(before)
