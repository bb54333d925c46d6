"""A session's turn copies a donor's pages (dataplane/serving_pages.py): the resident ones at once,
the ones still landing in the awaited restore once it is verified, read from their landing slots
meanwhile."""
import torch

from residency.dataplane.pools import DevicePool
from residency.dataplane.serving_pages import copy_landed, take_copies
from tests.dataplane.helpers_dataplane import LAYOUT


def random_rows(pool, slots):
    for s in slots:
        pool.words[s] = torch.randint(-2**31, 2**31 - 1, (LAYOUT.block_words,), dtype=torch.int32)


def test_resident_pages_are_copied_now_and_landing_ones_once_their_restore_is_verified():
    pool = DevicePool(LAYOUT, 16)
    pool.words.copy_(torch.randint(-2**31, 2**31 - 1, pool.words.shape, dtype=torch.int32))   # stale, never zeros
    resident = pool.allocate([10, 11])
    random_rows(pool, resident)
    landing_slots = pool.reserve([12, 13])                        # the awaited restore's, not published
    random_rows(pool, landing_slots)
    problem, later, reads = take_copies(pool, [10, 11, 12, 13], [20, 21, 22, 23], dict(zip([12, 13], landing_slots)))
    assert problem is None and later == [(12, 22), (13, 23)]
    assert reads == {22: landing_slots[0], 23: landing_slots[1]}  # the prefill reads the source meanwhile
    for src, dst in ((10, 20), (11, 21)):
        assert torch.equal(pool.words[pool.slot_of(dst)], pool.words[pool.slot_of(src)])
    assert not torch.equal(pool.words[pool.slot_of(22)], pool.words[landing_slots[0]])     # not yet
    pool.publish([12, 13])                                         # verified
    copy_landed(pool, later)
    for src, dst in ((12, 22), (13, 23)):
        assert torch.equal(pool.words[pool.slot_of(dst)], pool.words[pool.slot_of(src)])
    pool.check_integrity()


def test_no_room_for_the_copies_is_a_problem_with_nothing_allocated():
    pool = DevicePool(LAYOUT, 3)
    pool.allocate([1, 2])
    problem, later, reads = take_copies(pool, [1, 2], [5, 6], None)
    assert problem.startswith("no room for the copied pages") and later == [] and reads == {}
    assert not pool.has(5) and not pool.has(6)
