"""A serving worker's restores land layer by layer (dataplane/moves/layered.py): same bytes, same
verification, same all-or-nothing outcome as the plain restore; each layer's gate opens once that
layer of every block is in, and the pages stay unpublished until the checksums matched."""
import random

import pytest
import torch

from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import (LAYOUT, MOVER_DEVICES, commit, make_mover, move, moved_off_device,
                                               words_of)

L = LAYOUT.num_layers
COLS = LAYOUT.block_words // L


@pytest.fixture(params=MOVER_DEVICES)
def layered(tmp_path, request):
    m = make_mover(tmp_path / "disk", device=request.param, layered_restores=True)
    yield m
    m.close()


def parked(mover, blocks):
    return moved_off_device(mover, blocks, "host")


def test_a_layered_restore_lands_every_byte_and_is_verified(layered):
    blocks = random.sample(range(100), 5)
    data = parked(layered, blocks)
    cmd = move("restore", "host", "device", blocks)
    layered.submit_own(cmd)
    gates, slots = layered.landing(cmd.move_id)
    assert len(gates) == L and sorted(slots) == sorted(blocks)
    assert not any(layered.device_pool.has(b) for b in blocks)        # landing: not readable yet
    for g in gates:
        g.wait()
        if hasattr(g, "synchronize"):
            g.synchronize()
    out = layered.wait(cmd.move_id)
    assert isinstance(out, MoveAcked) and out.checksum_ok and out.bytes_moved == len(blocks) * LAYOUT.block_bytes
    for b in blocks:
        assert torch.equal(words_of(layered, "device", b), data[b])
        assert not layered.host_pool.holds(b)                           # a restore frees its source
    assert layered.landing(cmd.move_id) is None
    layered.check_integrity()


def test_each_gate_opens_on_its_own_layer_of_every_block(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    blocks = [3, 7, 8]
    data = parked(mover, blocks)
    cmd = move("restore", "host", "device", blocks)
    mover.submit_own(cmd)
    gates, slots = mover.landing(cmd.move_id)
    for layer, g in enumerate(gates):
        g.wait()                       # layer l is in for every block once its gate is open
        for b in blocks:
            lo, hi = layer * COLS, (layer + 1) * COLS
            assert torch.equal(mover.device_pool.words[slots[b], lo:hi], data[b][lo:hi])
    assert isinstance(mover.wait(cmd.move_id), MoveAcked)
    mover.close()


def test_a_corrupted_host_copy_fails_the_layered_restore_and_leaves_nothing_published(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True)
    blocks = [1, 2, 3]
    parked(mover, blocks)
    mover.host_pool.words[mover.host_pool.slot_of(2), 5] ^= 1 << 9
    cmd = move("restore", "host", "device", blocks)
    mover.submit_own(cmd)
    for g in mover.landing(cmd.move_id)[0]:
        g.wait()                                  # a reader may have read them: it must learn they failed
    out = mover.wait(cmd.move_id)
    assert isinstance(out, MoveFailed) and "block 2:" in out.error and "block 1:" not in out.error
    assert not any(mover.device_pool.holds(b) for b in blocks)
    assert all(mover.host_pool.has(b) for b in blocks)                 # the source stays
    mover.check_integrity()
    mover.close()


def test_a_move_kept_for_its_own_wait_is_never_settled_beside_another(tmp_path):
    mover = make_mover(tmp_path / "d", layered_restores=True, pipeline_blocks=1)    # moves of several chunks
    parked(mover, [1, 2])
    commit(mover, "device", [9, 10, 11])
    kept = move("restore", "host", "device", [1, 2])
    mover.submit_own(kept)
    mover.landing(kept.move_id)[0][-1].wait()          # landed: a move settling others beside it would take it
    assert isinstance(mover.execute(move("spill", "device", "host", [9, 10, 11])), MoveAcked)
    assert mover.outcome_of(kept.move_id) is None and mover.landing(kept.move_id) is not None
    assert isinstance(mover.wait(kept.move_id), MoveAcked)
    mover.close()
