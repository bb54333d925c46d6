from residency.events import catalog as ev
from residency.control.diagnose import detect_device_below_floor, detect_pinned_over_budget
from tests.diagnose.ledgers import SECOND


def test_pinned_host_bytes_over_the_host_ceiling_are_named_until_released(L):
    bb = L.worker(0, host_blocks=100)
    ceiling = 40 * bb
    budget = L.add(ev.BudgetSet(worker=0, tier="host", floor_bytes=0, ceiling_bytes=ceiling))
    L.add(ev.PinnedRegistered(worker=0, owner="host_pool", bytes=30 * bb))
    over = L.add(ev.PinnedRegistered(worker=0, owner="staging", bytes=L.rng.randrange(11, 30) * bb))
    [f] = detect_pinned_over_budget(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.onset_ns == over.envelope.ts_ns and {budget.seq, over.seq} <= set(f.seqs)
    assert f.detail["peak_bytes"] == 30 * bb + over.event.bytes and f.detail["budget_bytes"] == ceiling
    L.wait(10)
    back = L.add(ev.PinnedReleased(worker=0, owner="staging", bytes=over.event.bytes))
    L.chatter(10)
    [f] = detect_pinned_over_budget(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns == back.envelope.ts_ns


def test_without_a_host_budget_the_host_capacity_is_the_limit(L):
    bb = L.worker(0, host_blocks=64)
    L.add(ev.PinnedRegistered(worker=0, owner="host_pool", bytes=64 * bb))     # the whole pool: fine
    assert detect_pinned_over_budget(L.events, at_ns=L.now) == []
    L.add(ev.PinnedRegistered(worker=0, owner="extra", bytes=bb))
    assert len(detect_pinned_over_budget(L.events, at_ns=L.now)) == 1


def test_a_release_of_more_than_was_pinned_is_a_negative_pin_count(L):
    bb = L.worker(0)
    L.add(ev.PinnedRegistered(worker=0, owner="staging", bytes=2 * bb))
    bad = L.add(ev.PinnedReleased(worker=0, owner="staging", bytes=5 * bb))
    [f] = detect_pinned_over_budget(L.events, at_ns=L.now)
    assert "negative" in f.title and f.detail["excess_bytes"] == 3 * bb and bad.seq in f.seqs


def test_pins_within_budget_are_not_a_finding(L):
    bb = L.worker(0, host_blocks=100)
    L.add(ev.BudgetSet(worker=0, tier="host", floor_bytes=0, ceiling_bytes=50 * bb))
    for _ in range(10):
        L.add(ev.PinnedRegistered(worker=0, owner="staging", bytes=5 * bb))
        L.add(ev.PinnedReleased(worker=0, owner="staging", bytes=5 * bb))
    L.add(ev.PinnedRegistered(worker=0, owner="pool", bytes=50 * bb))
    assert detect_pinned_over_budget(L.events, at_ns=L.now) == []


def test_device_free_bytes_under_the_floor_are_named_with_the_lowest_point(L):
    bb = L.worker(0, device_blocks=32)
    budget = L.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=6 * bb, ceiling_bytes=32 * bb))
    L.commit(0, 20)
    crossing = L.commit(0, 8)                     # 4 blocks free < floor of 6
    dip = L.events[-1]
    L.commit(0, 1)                                # 3 free: the lowest
    [f] = detect_device_below_floor(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None and f.onset_ns == dip.envelope.ts_ns
    assert f.detail["lowest_free_bytes"] == 3 * bb and f.detail["floor_bytes"] == 6 * bb
    assert {budget.seq, dip.seq} <= set(f.seqs)
    L.wait(1)
    L.move(0, "evict", "device", "host", crossing)
    L.chatter(30)
    [f] = detect_device_below_floor(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns is not None


def test_a_device_with_room_above_its_floor_is_not_a_finding(L):
    bb = L.worker(0, device_blocks=32)
    L.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=6 * bb, ceiling_bytes=32 * bb))
    for _ in range(5):
        blocks = L.commit(0, 26)                  # exactly 6 free: at the floor, not under it
        L.free(0, blocks)
    assert detect_device_below_floor(L.events, at_ns=L.now + 60 * SECOND) == []
