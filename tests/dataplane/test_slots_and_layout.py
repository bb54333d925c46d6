"""SlotTable bookkeeping and the block-first KV layout."""
import pytest
import torch

from residency.dataplane.pools import (
    AlreadyResident,
    BlockNotReady,
    DevicePool,
    IntegrityError,
    KVLayout,
    LayoutError,
    NoRoom,
    NotResident,
    SlotTable,
)


def test_slots_go_lowest_first_and_come_back_on_the_last_reference():
    t = SlotTable("device", 5, 100)
    assert t.allocate([10, 11, 12]) == [0, 1, 2]
    t.incref([11])
    assert t.free([11]) == 0 and t.has(11)               # still held
    assert t.free([10, 11]) == 200
    assert t.allocate([13]) == [0]
    t.check_integrity()


def test_a_reserved_block_has_a_slot_but_cannot_be_read():
    t = SlotTable("device", 3, 8)
    t.reserve([7])
    with pytest.raises(BlockNotReady):
        t.slot_of(7)
    assert t.used_bytes == 8
    t.cancel([7])
    assert t.used_bytes == 0 and not t.holds(7)
    t.reserve([7])
    t.publish([7])
    assert t.slot_of(7) == 0 and t.refcount(7) == 1


def test_mutations_are_all_or_nothing():
    t = SlotTable("host", 3, 8)
    t.allocate([1, 2])
    with pytest.raises(NotResident):
        t.free([1, 99])
    assert t.has(1)
    with pytest.raises(AlreadyResident):
        t.allocate([3, 2])
    assert not t.holds(3)
    with pytest.raises(NoRoom, match="asked 16 bytes, available 8 bytes"):
        t.allocate([4, 5])
    with pytest.raises(NotResident):
        t.free([1, 1])                                   # one reference cannot be dropped twice
    t.check_integrity()


@pytest.mark.parametrize("breakage,needle", [
    (lambda t: t._free.append(0), "free list has duplicates|both free and taken"),
    (lambda t: t._free.pop(), r"free \d+ \+ taken \d+ != total 4"),
    (lambda t: t._refs.__setitem__(1, 0), "refcount < 1"),
    (lambda t: t._block.__setitem__(0, 99), "maps disagree"),
])
def test_check_integrity_raises_with_the_numbers(breakage, needle):
    t = SlotTable("device", 4, 8)
    t.allocate([1, 2])
    breakage(t)
    with pytest.raises(IntegrityError, match=needle):
        t.check_integrity()


def test_layout_sizes_and_the_pool_shape():
    lay = KVLayout(num_layers=32, page_tokens=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert lay.block_shape == (32, 2, 16, 8, 128)
    assert lay.page_bytes == 32 * 1024 and lay.block_bytes == 64 * 32 * 1024   # 64 chunks of 32 KiB
    assert KVLayout(3, 5, 2, 6, "float32").block_bytes == 3 * 2 * 5 * 2 * 6 * 4
    with pytest.raises(LayoutError, match="head_dim"):
        KVLayout(1, 1, 1, 0)
    with pytest.raises(LayoutError, match="not supported"):
        KVLayout(1, 1, 1, 2, torch.float64)


def test_a_block_is_one_contiguous_span_and_attention_pages_are_contiguous():
    lay = KVLayout(num_layers=3, page_tokens=5, num_kv_heads=2, head_dim=6, dtype=torch.float16)
    pool = DevicePool(lay, 4)
    assert pool.tensor.shape == (4, 3, 2, 5, 2, 6)
    s = pool.allocate([42])[0]
    blk = pool.tensor[s]
    assert blk.is_contiguous() and blk.untyped_storage().data_ptr() == pool.tensor.untyped_storage().data_ptr()
    assert blk.data_ptr() - pool.tensor.data_ptr() == s * lay.block_bytes
    page = pool.tensor[s, 2, 1]                              # layer 2, V
    assert page.is_contiguous() and page.numel() * 2 == lay.page_bytes
    pool.tensor[s].copy_(torch.randn(lay.block_shape).half())
    assert torch.equal(pool.words[s].view(torch.float16).view(lay.block_shape), pool.tensor[s])
    assert pool.block_table([42]).tolist() == [s]


def test_only_reserved_blocks_can_be_published_or_cancelled():
    t = SlotTable("device", 3, 8)
    t.allocate([1])
    with pytest.raises(NotResident):
        t.publish([1])                                   # already READY: not arriving
    with pytest.raises(NotResident):
        t.publish([2])                                   # never reserved
    with pytest.raises(NotResident):
        t.cancel([1])
    assert t.refcount(1) == 1 and not t.holds(2)
    t.check_integrity()


def test_checked_ahead_free_and_publish_say_no_where_the_checked_calls_would_raise():
    from residency.dataplane.pools.slots import SlotTable

    t = SlotTable("device", 8, 100)
    t.allocate([1, 2, 3])
    t.incref([3])
    t.reserve([5, 6])
    assert t.can_free_all([1, 2])
    assert not t.can_free_all([1, 3])          # 3 has a second holder
    assert not t.can_free_all([1, 1])          # listed twice
    assert not t.can_free_all([1, 4])          # 4 is not here
    assert not t.can_free_all([1, 5])          # 5 is still arriving
    assert not t.can_free_all([])
    assert t.can_publish([5, 6]) and not t.can_publish([5, 1])
    assert t.free_all_checked([2, 1]) == 200
    t.publish_checked([6, 5])
    assert t.ready_blocks() == [3, 5, 6] and t.refcount(5) == 1 and t.num_free == 5
    t.check_integrity()
