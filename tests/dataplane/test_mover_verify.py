"""Restores verify checksums before blocks become visible: a bad copy fails the move, names the
block, and leaves the destination pool exactly as it was."""
import os

import pytest
import torch

from residency.dataplane.pools.disk import HEADER_BYTES
from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import LAYOUT, assert_same, commit, move, snapshot, words_of

BB = LAYOUT.block_bytes


def failed(mover, cmd) -> MoveFailed:
    before = snapshot(mover)
    out = mover.execute(cmd)
    assert isinstance(out, MoveFailed), out
    assert_same(snapshot(mover), before)
    mover.check_integrity()
    return out


def flip_bit(t: torch.Tensor, word: int, bit: int) -> None:
    t[word] ^= torch.tensor((1 << bit) - ((1 << 32) if bit == 31 else 0), dtype=torch.int32)


def test_a_flipped_bit_in_a_host_copy_fails_the_restore_and_names_the_block(mover):
    data = commit(mover, "device", [1, 2, 3])
    mover.execute(move("evict", "device", "host", [1, 2, 3]))
    flip_bit(mover.host_pool.words[mover.host_pool.slot_of(2)], word=77, bit=13)
    out = failed(mover, move("restore", "host", "device", [1, 2, 3]))
    assert "block 2:" in out.error and "block 1:" not in out.error and "block 3:" not in out.error
    assert out.bytes_moved == 3 * BB                      # the bytes did cross; they were not used
    assert not mover.device_pool.holds(1)               # no partial restore either
    ok = mover.execute(move("restore", "host", "device", [1, 3]))
    assert isinstance(ok, MoveAcked)
    assert torch.equal(words_of(mover, "device", 3), data[3])


def test_two_swapped_host_copies_fail_the_restore_naming_both(mover):
    commit(mover, "device", [5, 6, 7])
    mover.execute(move("evict", "device", "host", [5, 6, 7]))
    hp = mover.host_pool
    s5, s7 = hp.slot_of(5), hp.slot_of(7)
    hp.words[[s5, s7]] = hp.words[[s7, s5]].clone()
    out = failed(mover, move("restore", "host", "device", [5, 6, 7]))
    assert "block 5:" in out.error and "block 7:" in out.error and "block 6:" not in out.error


def _spill_to_disk(mover, blocks):
    data = commit(mover, "device", blocks)
    assert isinstance(mover.execute(move("evict", "device", "disk", blocks)), MoveAcked)
    return data


def test_a_corrupted_disk_payload_fails_the_restore(mover):
    _spill_to_disk(mover, [1, 2])
    path = mover.disk_tier.path_of(2)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 101)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 101)
        f.write(bytes([byte[0] ^ 0x10]))
    out = failed(mover, move("restore", "disk", "device", [1, 2]))
    assert "block 2:" in out.error and "disk->device" in out.error


def test_a_truncated_disk_file_fails_the_restore(mover):
    _spill_to_disk(mover, [1, 2])
    path = mover.disk_tier.path_of(1)
    os.truncate(path, HEADER_BYTES + BB // 2)
    out = failed(mover, move("restore", "disk", "device", [2, 1]))
    assert "block 1 is truncated" in out.error and f"{BB // 2} of {BB}" in out.error


def test_a_missing_disk_file_fails_the_restore_and_is_forgotten(mover):
    _spill_to_disk(mover, [1, 2])
    os.unlink(mover.disk_tier.path_of(2))
    before = snapshot(mover)
    out = mover.execute(move("restore", "disk", "device", [1, 2]))
    assert isinstance(out, MoveFailed) and "block 2 is missing" in out.error
    after = snapshot(mover)
    assert after["device"] == before["device"]           # device pool unchanged
    assert not mover.disk_tier.has(2) and mover.disk_tier.has(1)   # the vanished copy is gone
    mover.check_integrity()


def test_a_damaged_header_is_named_as_such(mover):
    _spill_to_disk(mover, [4])
    with open(mover.disk_tier.path_of(4), "r+b") as f:
        f.seek(33)                                        # inside the checksum field
        was = f.read(2)
        f.seek(33)
        f.write(bytes(b ^ 0xFF for b in was))             # changed whatever it held
    out = failed(mover, move("restore", "disk", "device", [4]))
    assert "block 4 has a damaged header" in out.error


def test_a_file_holding_another_block_is_refused(mover):
    _spill_to_disk(mover, [1, 2])
    os.replace(mover.disk_tier.path_of(1), mover.disk_tier.path_of(2))
    out = failed(mover, move("restore", "disk", "device", [2]))
    assert "block 2 holds block 1" in out.error


def test_promote_of_a_corrupted_file_leaves_the_host_pool_unchanged(mover):
    _spill_to_disk(mover, [8])
    with open(mover.disk_tier.path_of(8), "r+b") as f:
        f.seek(HEADER_BYTES + BB - 1)
        was = f.read(1)[0]
        f.seek(HEADER_BYTES + BB - 1)
        f.write(bytes([was ^ 0x5A]))                      # a write of a fixed byte may change nothing
    out = failed(mover, move("promote", "disk", "host", [8]))
    assert "block 8:" in out.error


def test_demote_refuses_to_write_a_host_copy_that_no_longer_matches(mover):
    commit(mover, "device", [3])
    mover.execute(move("evict", "device", "host", [3]))
    flip_bit(mover.host_pool.words[mover.host_pool.slot_of(3)], word=0, bit=31)
    out = failed(mover, move("demote", "host", "disk", [3], keep_source=False))
    assert "block 3:" in out.error
    assert not os.path.exists(mover.disk_tier.path_of(3))
    assert [n for n in os.listdir(mover.disk_tier.directory) if n.endswith(".tmp")] == []


def test_a_restore_blocks_are_invisible_until_verified(mover):
    from residency.dataplane.pools import BlockNotReady

    commit(mover, "device", [1])
    mover.execute(move("evict", "device", "host", [1]))
    ticket = mover.submit(move("restore", "host", "device", [1]))
    with pytest.raises(BlockNotReady):
        mover.device_pool.slot_of(1)
    assert mover.usage()["device"] == BB                 # reserved slots are taken
    mover.check_integrity()
    assert isinstance(mover.wait(ticket), MoveAcked)
    mover.device_pool.slot_of(1)
