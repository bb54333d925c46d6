"""Restores verify checksums before blocks become visible: a bad copy fails the move, names the
block, and leaves the destination pool exactly as it was."""
import os

import pytest
import torch

from residency.dataplane.pools.disk import HEADER_BYTES
from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import LAYOUT, assert_same, commit, move, snapshot, words_of

BB = LAYOUT.block_bytes


def failed(engine, cmd) -> MoveFailed:
    before = snapshot(engine)
    out = engine.execute(cmd)
    assert isinstance(out, MoveFailed), out
    assert_same(snapshot(engine), before)
    engine.check_integrity()
    return out


def flip_bit(t: torch.Tensor, word: int, bit: int) -> None:
    t[word] ^= torch.tensor((1 << bit) - ((1 << 32) if bit == 31 else 0), dtype=torch.int32)


def test_a_flipped_bit_in_a_host_copy_fails_the_restore_and_names_the_block(engine):
    data = commit(engine, "device", [1, 2, 3])
    engine.execute(move("evict", "device", "host", [1, 2, 3]))
    flip_bit(engine.host_pool.words[engine.host_pool.slot_of(2)], word=77, bit=13)
    out = failed(engine, move("restore", "host", "device", [1, 2, 3]))
    assert "block 2:" in out.error and "block 1:" not in out.error and "block 3:" not in out.error
    assert out.bytes_moved == 3 * BB                      # the bytes did cross; they were not used
    assert not engine.device_pool.holds(1)               # no partial restore either
    ok = engine.execute(move("restore", "host", "device", [1, 3]))
    assert isinstance(ok, MoveAcked)
    assert torch.equal(words_of(engine, "device", 3), data[3])


def test_two_swapped_host_copies_fail_the_restore_naming_both(engine):
    commit(engine, "device", [5, 6, 7])
    engine.execute(move("evict", "device", "host", [5, 6, 7]))
    hp = engine.host_pool
    s5, s7 = hp.slot_of(5), hp.slot_of(7)
    hp.words[[s5, s7]] = hp.words[[s7, s5]].clone()
    out = failed(engine, move("restore", "host", "device", [5, 6, 7]))
    assert "block 5:" in out.error and "block 7:" in out.error and "block 6:" not in out.error


def _spill_to_disk(engine, blocks):
    data = commit(engine, "device", blocks)
    assert isinstance(engine.execute(move("evict", "device", "disk", blocks)), MoveAcked)
    return data


def test_a_corrupted_disk_payload_fails_the_restore(engine):
    _spill_to_disk(engine, [1, 2])
    path = engine.disk_tier.path_of(2)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 101)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 101)
        f.write(bytes([byte[0] ^ 0x10]))
    out = failed(engine, move("restore", "disk", "device", [1, 2]))
    assert "block 2:" in out.error and "disk->device" in out.error


def test_a_truncated_disk_file_fails_the_restore(engine):
    _spill_to_disk(engine, [1, 2])
    path = engine.disk_tier.path_of(1)
    os.truncate(path, HEADER_BYTES + BB // 2)
    out = failed(engine, move("restore", "disk", "device", [2, 1]))
    assert "block 1 is truncated" in out.error and f"{BB // 2} of {BB}" in out.error


def test_a_missing_disk_file_fails_the_restore_and_is_forgotten(engine):
    _spill_to_disk(engine, [1, 2])
    os.unlink(engine.disk_tier.path_of(2))
    before = snapshot(engine)
    out = engine.execute(move("restore", "disk", "device", [1, 2]))
    assert isinstance(out, MoveFailed) and "block 2 is missing" in out.error
    after = snapshot(engine)
    assert after["device"] == before["device"]           # device pool unchanged
    assert not engine.disk_tier.has(2) and engine.disk_tier.has(1)   # the vanished copy is gone
    engine.check_integrity()


def test_a_damaged_header_is_named_as_such(engine):
    _spill_to_disk(engine, [4])
    with open(engine.disk_tier.path_of(4), "r+b") as f:
        f.seek(33)                                        # inside the checksum field
        was = f.read(2)
        f.seek(33)
        f.write(bytes(b ^ 0xFF for b in was))             # changed whatever it held
    out = failed(engine, move("restore", "disk", "device", [4]))
    assert "block 4 has a damaged header" in out.error


def test_a_file_holding_another_block_is_refused(engine):
    _spill_to_disk(engine, [1, 2])
    os.replace(engine.disk_tier.path_of(1), engine.disk_tier.path_of(2))
    out = failed(engine, move("restore", "disk", "device", [2]))
    assert "block 2 holds block 1" in out.error


def test_promote_of_a_corrupted_file_leaves_the_host_pool_unchanged(engine):
    _spill_to_disk(engine, [8])
    with open(engine.disk_tier.path_of(8), "r+b") as f:
        f.seek(HEADER_BYTES + BB - 1)
        was = f.read(1)[0]
        f.seek(HEADER_BYTES + BB - 1)
        f.write(bytes([was ^ 0x5A]))                      # a write of a fixed byte may change nothing
    out = failed(engine, move("promote", "disk", "host", [8]))
    assert "block 8:" in out.error


def test_demote_refuses_to_write_a_host_copy_that_no_longer_matches(engine):
    commit(engine, "device", [3])
    engine.execute(move("evict", "device", "host", [3]))
    flip_bit(engine.host_pool.words[engine.host_pool.slot_of(3)], word=0, bit=31)
    out = failed(engine, move("demote", "host", "disk", [3], keep_source=False))
    assert "block 3:" in out.error
    assert not os.path.exists(engine.disk_tier.path_of(3))
    assert [n for n in os.listdir(engine.disk_tier.directory) if n.endswith(".tmp")] == []


def test_a_restore_blocks_are_invisible_until_verified(engine):
    from residency.dataplane.pools import BlockNotReady

    commit(engine, "device", [1])
    engine.execute(move("evict", "device", "host", [1]))
    ticket = engine.submit(move("restore", "host", "device", [1]))
    with pytest.raises(BlockNotReady):
        engine.device_pool.slot_of(1)
    assert engine.usage()["device"] == BB                 # reserved slots are taken
    engine.check_integrity()
    assert isinstance(engine.wait(ticket), MoveAcked)
    engine.device_pool.slot_of(1)
