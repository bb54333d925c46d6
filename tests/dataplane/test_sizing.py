"""The device pool's size from measured memory: the arithmetic, whole blocks, and a refusal that
carries its numbers."""
from __future__ import annotations

import random

import pytest

from residency.dataplane import sizing as sz

GIB = 1 << 30


def test_the_pool_is_the_share_less_what_is_in_use_and_the_reserve_in_whole_blocks():
    rng = random.Random(7)
    total, in_use, reserve, bb = 80 * GIB, rng.randrange(10, 20) * GIB + rng.randrange(GIB), GIB, rng.randrange(1 << 16, 1 << 20)
    s = sz.size_pool(device="cuda:0", total_bytes=total, in_use_bytes=in_use, fraction=0.8, reserve_bytes=reserve,
                     weights_bytes=in_use // 2, block_bytes=bb, min_blocks=512)
    left = int(0.8 * total) - in_use - reserve
    assert s.how == "fraction" and s.num_blocks == left // bb and s.pool_bytes == s.num_blocks * bb
    assert 0 <= left - s.pool_bytes < bb
    assert (s.budget_bytes, s.in_use_bytes, s.reserve_bytes, s.total_bytes) == (int(0.8 * total), in_use, reserve, total)


def test_weights_that_leave_no_room_for_one_full_context_are_refused_with_the_arithmetic():
    with pytest.raises(sz.PoolSizingRefused) as e:
        sz.size_pool(device="cpu", total_bytes=8 * GIB, in_use_bytes=GIB, fraction=0.15, reserve_bytes=64 << 20,
                     weights_bytes=GIB // 2, block_bytes=737280, min_blocks=512)
    s = e.value.sizing
    assert s.how == "refused" and s.num_blocks < 512
    msg = str(e.value)
    assert "does not fit" in msg and "0.15" in msg and "512 blocks" in msg and "1.20 GiB" in msg   # 0.15 x 8 GiB


def test_exactly_the_minimum_is_enough_and_one_byte_less_is_refused():
    bb, n = 4096 * 3, 40
    need = n * bb
    ok = sz.size_pool(device="cpu", total_bytes=1000 * bb, in_use_bytes=1000 * bb // 2 - need - 7, fraction=0.5,
                      reserve_bytes=7, weights_bytes=0, block_bytes=bb, min_blocks=n)
    assert ok.num_blocks == n
    with pytest.raises(sz.PoolSizingRefused):
        sz.size_pool(device="cpu", total_bytes=1000 * bb, in_use_bytes=1000 * bb // 2 - need - 6, fraction=0.5,
                     reserve_bytes=7, weights_bytes=0, block_bytes=bb, min_blocks=n)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_an_error(fraction):
    with pytest.raises(ValueError, match="fraction"):
        sz.size_pool(device="cpu", total_bytes=GIB, in_use_bytes=0, fraction=fraction, reserve_bytes=0,
                     weights_bytes=0, block_bytes=4096, min_blocks=1)


def test_the_minimum_is_one_sequence_of_the_whole_context():
    assert sz.min_blocks_for(8192, 16) == 512
    assert sz.min_blocks_for(8193, 16) == 513
    assert sz.min_blocks_for(None, 16) == sz.MIN_BLOCKS_NO_MODEL


def test_an_explicit_count_measures_nothing():
    s = sz.explicit("cpu", 192, 1000, 5)
    assert s.how == "explicit" and s.pool_bytes == 192_000 and s.total_bytes is None and s.in_use_bytes is None
    assert "--device-blocks" in sz.explain(s)


def test_a_cpu_meter_reads_the_ram_free_at_start_and_its_own_resident_set():
    m = sz.Meter("cpu")
    total, in_use = m.measure()
    assert 0 < in_use < total <= sz.meminfo()["MemTotal"] + in_use
