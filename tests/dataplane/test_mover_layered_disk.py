"""A serving worker's restores from disk land layer by layer too (dataplane/moves/layered_disk.py):
bands of layers read from every file, each band's gates open once it is copied, the same bytes,
the same verification against the files' headers, the same all-or-nothing outcome."""
import os
import random
import threading

import pytest
import torch

from residency.dataplane.moves.layered_disk import layer_bands
from residency.dataplane.pools.disk import HEADER_BYTES
from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import (LAYOUT, MOVER_DEVICES, commit, make_mover, move, moved_off_device,
                                               words_of)

L = LAYOUT.num_layers
COLS = LAYOUT.block_words // L


def on_disk(mover, blocks):
    return moved_off_device(mover, blocks, "disk")


class HeldDma:
    """The mover's DMA issuer, holding every band after the first until ``go`` is set."""

    def __init__(self, base):
        self.base, self.go, self.bands_seen = base, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def copy_rows_to_cols(self, stream, dst, src, runs, lo):
        if lo > 0:
            self.go.wait(10)
        self.bands_seen.append(lo)
        self.base.copy_rows_to_cols(stream, dst, src, runs, lo)


@pytest.mark.parametrize("device", MOVER_DEVICES)
@pytest.mark.parametrize("read_bytes", [1, None])          # a band per layer; the default (one band here)
def test_a_layered_restore_from_disk_lands_every_byte_and_is_verified(tmp_path, device, read_bytes):
    mover = make_mover(tmp_path / "d", device=device, layered_restores=True)
    if read_bytes is not None:
        mover.ctx.disk_read_bytes = read_bytes
    blocks = random.sample(range(100), 6)
    data = on_disk(mover, blocks)
    cmd = move("restore", "disk", "device", blocks)
    mover.submit_own(cmd)
    gates, slots = mover.landing(cmd.move_id)
    assert len(gates) == L and sorted(slots) == sorted(blocks)
    assert not any(mover.device_pool.has(b) for b in blocks)          # landing: not readable yet
    out = mover.wait(cmd.move_id)
    assert isinstance(out, MoveAcked) and out.checksum_ok and out.bytes_moved == len(blocks) * LAYOUT.block_bytes
    for b in blocks:
        assert torch.equal(words_of(mover, "device", b), data[b])
        assert not mover.disk_tier.has(b)                               # a restore frees its source
    assert mover.landing(cmd.move_id) is None
    mover.check_integrity()
    mover.close()


def test_each_band_opens_its_own_layers_gates_and_no_other(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    mover.ctx.disk_read_bytes = 1                                       # one layer a band
    held = mover.ctx.dma = HeldDma(mover.ctx.dma)
    blocks = [3, 7, 8, 11]
    data = on_disk(mover, blocks)
    cmd = move("restore", "disk", "device", blocks)
    mover.submit_own(cmd)
    gates, slots = mover.landing(cmd.move_id)
    assert gates[0].wait(10)
    assert not any(g.is_set() for g in gates[1:])                       # the next bands are held
    assert mover.ctx.ring.lock.locked()                                 # the reader holds the staging ring
    for b in blocks:
        assert torch.equal(mover.device_pool.words[slots[b], :COLS], data[b][:COLS])
    held.go.set()
    for layer, g in enumerate(gates):
        assert g.wait(10)
        for b in blocks:
            lo, hi = layer * COLS, (layer + 1) * COLS
            assert torch.equal(mover.device_pool.words[slots[b], lo:hi], data[b][lo:hi])
    assert isinstance(mover.wait(cmd.move_id), MoveAcked)
    assert sorted(set(held.bands_seen)) == [layer * COLS for layer in range(L)]
    mover.close()


def flip_in_file(mover, block: int, word: int) -> None:
    with open(mover.disk_tier.path_of(block), "r+b") as f:
        f.seek(HEADER_BYTES + 4 * word)
        b = f.read(1)
        f.seek(HEADER_BYTES + 4 * word)
        f.write(bytes([b[0] ^ 0x20]))


def test_a_corrupted_disk_file_fails_the_layered_restore_and_leaves_nothing_published(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    mover.ctx.disk_read_bytes = 1
    blocks = [1, 2, 3]
    on_disk(mover, blocks)
    flip_in_file(mover, 2, (L - 1) * COLS + 3)                         # in the last layer's band
    cmd = move("restore", "disk", "device", blocks)
    mover.submit_own(cmd)
    for g in mover.landing(cmd.move_id)[0]:
        g.wait()                                  # a reader may have read them: it must learn they failed
    out = mover.wait(cmd.move_id)
    assert isinstance(out, MoveFailed) and "block 2:" in out.error and "block 1:" not in out.error
    assert not any(mover.device_pool.holds(b) for b in blocks)          # nothing published, nothing reserved
    assert all(mover.disk_tier.has(b) for b in blocks)                  # the files stay (the control decides)
    assert not mover.device_pool.table.reserved_blocks()
    mover.check_integrity()
    mover.close()


def test_a_missing_file_fails_the_restore_naming_it_and_is_forgotten(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    blocks = [4, 5]
    on_disk(mover, blocks)
    os.unlink(mover.disk_tier.path_of(5))
    cmd = move("restore", "disk", "device", blocks)
    mover.submit_own(cmd)
    out = mover.wait(cmd.move_id)
    assert isinstance(out, MoveFailed) and "block 5 is missing" in out.error
    assert not mover.disk_tier.has(5) and mover.disk_tier.has(4)
    assert not any(mover.device_pool.holds(b) for b in blocks)
    mover.check_integrity()
    mover.close()


def test_a_disk_move_submitted_while_the_reader_holds_the_ring_waits_for_it(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    mover.ctx.disk_read_bytes = 1
    held = mover.ctx.dma = HeldDma(mover.ctx.dma)
    data = on_disk(mover, [1, 2])
    more = commit(mover, "device", [20, 21])
    kept = move("restore", "disk", "device", [1, 2])
    mover.submit_own(kept)
    assert mover.landing(kept.move_id)[0][0].wait(10)
    threading.Timer(0.05, held.go.set).start()       # the ring is freed only once the reader is through
    assert isinstance(mover.execute(move("spill", "device", "disk", [20, 21])), MoveAcked)
    assert isinstance(mover.wait(kept.move_id), MoveAcked)
    for b in (1, 2):
        assert torch.equal(words_of(mover, "device", b), data[b])
    for b in (20, 21):
        assert torch.equal(words_of(mover, "disk", b), more[b])
    mover.close()


def test_bands_cover_every_layer_once_with_reads_of_a_useful_size():
    assert layer_bands(32, 64 << 10, 256 << 10, 8) == [(i, i + 4) for i in range(0, 32, 4)]
    assert layer_bands(32, 1 << 20, 256 << 10, 8) == [(i, i + 4) for i in range(0, 32, 4)]   # at most 8
    assert layer_bands(3, 240, 1, 8) == [(0, 1), (1, 2), (2, 3)]
    assert layer_bands(3, 240, 256 << 10, 8) == [(0, 3)]
    assert layer_bands(30, 12 << 10, 64 << 10, 8) == [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30)]
    assert layer_bands(7, 10, 25, 8) == [(0, 3), (3, 6), (6, 7)]
    with pytest.raises(ValueError):
        layer_bands(0, 10)
