"""Moves enqueued in chunks: a spill and a restore submitted together advance in turn (pump), each
lands intact, and a chunk that raises half-way fails its move with the pools unchanged."""
import pytest
import torch

import residency.dataplane.moves.copy as copy_mod
from residency.events.catalog import MoveAcked, MoveFailed
from tests.dataplane.helpers_dataplane import assert_same, commit, make_mover, move, snapshot, words_of


@pytest.fixture
def chunky(tmp_path, mover_device):
    # 3 blocks per chunk: a 10-block move is a first chunk of 3 blocks (by plain DMAs, the link
    # starts at once), then chunks of 3, 3, 1: submit enqueues the first and two more, 1 is left.
    e = make_mover(tmp_path / "disk", device=mover_device, device_blocks=24, host_blocks=24, pipeline_blocks=3)
    yield e
    e.check_integrity()
    e.close()


OUT_IDS, IN_IDS = list(range(10)), list(range(10, 20))


def _spill_and_restore(e, monkeypatch):
    """OUT_IDS on the device, IN_IDS on the host; returns their bytes, the log of chunk enqueues
    (direction per Copier.enqueue) and the two commands (scattered orders on both sides)."""
    data = commit(e, "device", OUT_IDS + IN_IDS)
    assert isinstance(e.execute(move("evict", "device", "host", IN_IDS)), MoveAcked)
    real, log = copy_mod.Copier.enqueue, []
    monkeypatch.setattr(copy_mod.Copier, "enqueue", lambda self, lo, hi: (log.append(self.direction), real(self, lo, hi)))
    return data, log, (move("evict", "device", "host", OUT_IDS[::-1]),
                       move("restore", "host", "device", IN_IDS[3:] + IN_IDS[:3]))


def _landed_intact(e, data):
    for blk in OUT_IDS:
        assert torch.equal(words_of(e, "host", blk), data[blk]) and not e.device_pool.has(blk)
    for blk in IN_IDS:
        assert torch.equal(words_of(e, "device", blk), data[blk]) and not e.host_pool.has(blk)


def test_spill_and_restore_submitted_together_advance_in_turn_and_land_intact(chunky, monkeypatch):
    e = chunky
    data, log, (out_cmd, in_cmd) = _spill_and_restore(e, monkeypatch)
    t_out = e.submit(out_cmd)
    t_in = e.submit(in_cmd)
    moves = {m.cmd.move_id: m for m in e._inflight.values()}
    assert log == ["d2h"] * 3 + ["h2d"] * 3, "submit enqueues the first chunk and two more"
    assert all(m.pending is not None for m in moves.values())
    e.pump()
    assert log[6:] == ["d2h", "h2d"], "pump enqueues one more chunk of each move in flight"
    a = e.wait(t_in)
    assert len(log) == 8
    b = e.wait(t_out)
    assert isinstance(a, MoveAcked) and isinstance(b, MoveAcked), (a, b)
    assert all(m.pending is None for m in moves.values())
    _landed_intact(e, data)


@pytest.mark.parametrize("slice_blocks, pairs", [(8, 3), (1, 8)], ids=["one-slice", "block-by-block"])
def test_moves_submitted_together_reach_the_link_in_turn_then_advance_in_turn(chunky, monkeypatch, slice_blocks, pairs):
    """First chunks two pipeline chunks long (6 blocks: one slice of 8, or 6 slices of 1), a slice of
    each move in turn; then the two chunks left of each (3 blocks and 1), in turn."""
    import residency.dataplane.mover as mover_mod

    e = chunky
    monkeypatch.setattr(mover_mod, "FIRST_SLICE_BLOCKS", slice_blocks)
    monkeypatch.setattr(mover_mod, "FIRST_LEAD_BLOCKS", 0)          # no longer first step (below)
    data, log, cmds = _spill_and_restore(e, monkeypatch)
    t_out, t_in = e.submit_many(cmds)
    assert mover_mod.FIRST_CHUNKS_TOGETHER == 2
    assert log == ["d2h", "h2d"] * pairs, log
    a, b = e.wait(t_in), e.wait(t_out)
    assert isinstance(a, MoveAcked) and isinstance(b, MoveAcked), (a, b)
    _landed_intact(e, data)


def test_the_first_move_submitted_together_leads_with_a_longer_first_step(chunky, monkeypatch):
    """The spill's link gets FIRST_LEAD_BLOCKS blocks before the restore is admitted (validated,
    slots claimed), so it stays busy meanwhile; then slices of each in turn, and both land."""
    import residency.dataplane.mover as mover_mod

    e = chunky
    monkeypatch.setattr(mover_mod, "FIRST_SLICE_BLOCKS", 1)
    monkeypatch.setattr(mover_mod, "FIRST_LEAD_BLOCKS", 4)
    data = commit(e, "device", OUT_IDS + IN_IDS)
    assert isinstance(e.execute(move("evict", "device", "host", IN_IDS)), MoveAcked)
    real_enqueue, real_admit, log = copy_mod.Copier.enqueue, e._admit, []
    monkeypatch.setattr(copy_mod.Copier, "enqueue",
                        lambda self, lo, hi: (log.append((self.direction, lo, hi)), real_enqueue(self, lo, hi)))
    monkeypatch.setattr(e, "_admit", lambda cmd, record=True: (log.append(("admit", cmd.kind)), real_admit(cmd, record))[1])
    t_out, t_in = e.submit_many([move("evict", "device", "host", OUT_IDS[::-1]),
                                 move("restore", "host", "device", IN_IDS[3:] + IN_IDS[:3])])
    assert log[:8] == [("admit", "evict"), ("d2h", 0, 4), ("admit", "restore"), ("h2d", 0, 1),
                       ("d2h", 4, 5), ("h2d", 1, 2), ("d2h", 5, 6), ("h2d", 2, 3)], log
    a, b = e.wait(t_in), e.wait(t_out)
    assert isinstance(a, MoveAcked) and isinstance(b, MoveAcked), (a, b)
    _landed_intact(e, data)


def test_a_move_failing_half_way_through_its_first_chunk_fails_alone(chunky, monkeypatch):
    import residency.dataplane.mover as mover_mod

    e = chunky
    monkeypatch.setattr(mover_mod, "FIRST_SLICE_BLOCKS", 1)
    data, log, cmds = _spill_and_restore(e, monkeypatch)
    real, calls = copy_mod.Copier.enqueue, []

    def enqueue(self, lo, hi):
        calls.append(self.direction)
        if self.direction == "h2d" and calls.count("h2d") == 2:
            raise RuntimeError("h2d link went away")
        return real(self, lo, hi)

    monkeypatch.setattr(copy_mod.Copier, "enqueue", enqueue)
    t_out, t_in = e.submit_many(cmds)
    failed = e.wait(t_in)
    assert isinstance(failed, MoveFailed) and "h2d link went away" in failed.error, failed
    assert isinstance(e.wait(t_out), MoveAcked)
    for blk in IN_IDS:                            # the restore changed nothing: still on the host only
        assert e.host_pool.has(blk) and not e.device_pool.has(blk)
        assert torch.equal(words_of(e, "host", blk), data[blk])
    e.check_integrity()                           # its claimed device slots came back (free + taken = all)


def test_submit_many_refuses_a_move_that_collides_with_an_earlier_one_and_lands_the_rest(chunky):
    e = chunky
    ids = list(range(10))
    data = commit(e, "device", ids)
    first, clash = move("evict", "device", "host", ids[:6]), move("evict", "device", "disk", ids[4:])
    t1, t2 = e.submit_many([first, clash])
    refused = e.wait(t2)
    assert type(refused).__name__ == "MoveRejected" and refused.blocks == [4, 5], refused
    assert "busy" in refused.reason and first.move_id in refused.reason, refused
    assert isinstance(e.wait(t1), MoveAcked)
    for blk in ids[:6]:
        assert torch.equal(words_of(e, "host", blk), data[blk])
    assert all(e.device_pool.has(b) for b in ids[6:])


def test_a_move_whose_start_raises_in_submit_many_fails_alone(chunky, monkeypatch):
    import residency.dataplane.moves.device_host as dh

    e = chunky
    ids = list(range(10))
    data = commit(e, "device", ids)
    assert isinstance(e.execute(move("evict", "device", "host", ids[5:])), MoveAcked)
    before_host = {b: words_of(e, "host", b).clone() for b in ids[5:]}
    real = dh.SpillToHost.claim

    def claim(self, *args):
        real(self, *args)                         # its host slots are claimed: they must come back
        raise RuntimeError("link went away")

    monkeypatch.setattr(dh.SpillToHost, "claim", claim)
    t_out, t_in = e.submit_many([move("evict", "device", "host", ids[:5]), move("restore", "host", "device", ids[5:])])
    out = e.wait(t_out)
    assert isinstance(out, MoveFailed) and "link went away" in out.error, out
    assert all(e.device_pool.has(b) and not e.host_pool.holds(b) for b in ids[:5])
    assert isinstance(e.wait(t_in), MoveAcked)
    for b in ids[5:]:
        assert torch.equal(words_of(e, "device", b), before_host[b]) and torch.equal(before_host[b], data[b])


def test_a_chunk_that_raises_half_way_fails_the_move_and_changes_nothing(chunky, monkeypatch):
    e = chunky
    commit(e, "device", list(range(10)))
    before = snapshot(e)
    real, calls = copy_mod.Copier.enqueue, []

    def flaky(self, lo, hi):
        calls.append(lo)
        if len(calls) == 4:                              # the chunk pump enqueues, not submit's
            raise RuntimeError("copy engine fell over")
        return real(self, lo, hi)

    monkeypatch.setattr(copy_mod.Copier, "enqueue", flaky)
    ticket = e.submit(move("evict", "device", "host", list(range(10))))
    out = e.wait(ticket)
    assert isinstance(out, MoveFailed) and "copy engine fell over" in out.error, out
    assert len(calls) == 4
    assert_same(before, snapshot(e))
    assert e.wait(ticket) is out                         # the outcome is recorded once


def _flip(e, blk):
    e.host_pool.words[e.host_pool.slot_of(blk)][5] ^= 1 << 7


@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_a_bad_host_copy_in_any_chunk_fails_the_restore_and_changes_nothing(chunky, where):
    """The head's checksums are compared before the commit is applied, the last chunk's after it
    (the commit then undone): either way the pools, checksums and bytes are as before."""
    e = chunky
    ids = list(range(10))
    commit(e, "device", ids)
    assert isinstance(e.execute(move("evict", "device", "host", ids)), MoveAcked)
    by_slot = sorted(ids, key=e.host_pool.slot_of)       # a restore walks host-slot order
    bad = by_slot[1] if where == "first chunk" else by_slot[-1]
    _flip(e, bad)
    before = snapshot(e)
    out = e.execute(move("restore", "host", "device", ids[::-1]))
    assert isinstance(out, MoveFailed) and f"block {bad}:" in out.error, out
    assert_same(before, snapshot(e))
    e.check_integrity()


class _Broken:
    def synchronize(self):
        raise RuntimeError("device fell over while the last chunk crossed")

    def query(self):
        return False


class _BrokenLanded:
    def read(self):
        raise RuntimeError("device fell over while the last chunk crossed")


def test_a_spill_whose_last_wait_fails_puts_both_tables_back(chunky, monkeypatch):
    import residency.dataplane.moves.device_host as dh

    e = chunky
    ids = list(range(10))
    commit(e, "device", ids)
    before = snapshot(e)
    real = dh.SpillToHost._chunks

    def chunks(self, *args):
        yield from real(self, *args)
        self.copied = _Broken()

    monkeypatch.setattr(dh.SpillToHost, "_chunks", chunks)
    out = e.execute(move("evict", "device", "host", ids))
    assert isinstance(out, MoveFailed) and "fell over" in out.error, out
    assert_same(before, snapshot(e))


def test_a_restore_whose_last_wait_fails_puts_both_tables_back(chunky, monkeypatch):
    import residency.dataplane.moves.base as base

    e = chunky
    ids = list(range(10))
    commit(e, "device", ids)
    assert isinstance(e.execute(move("evict", "device", "host", ids)), MoveAcked)
    before = snapshot(e)
    real = base.Hasher.land

    def land(self, lo=0, hi=None, spin=False):
        got = real(self, lo, hi, spin)
        return _BrokenLanded() if spin else got          # the tail: its wait fails

    monkeypatch.setattr(base.Hasher, "land", land)
    out = e.execute(move("restore", "host", "device", ids))
    assert isinstance(out, MoveFailed) and "fell over" in out.error, out
    assert_same(before, snapshot(e))


@pytest.mark.parametrize("kind", ["evict", "restore"])
def test_a_move_that_fails_after_claiming_its_slots_gives_them_back(chunky, monkeypatch, kind):
    """Slots are claimed (and the first chunk copied into them) before the per-block maps are
    written; a failure in between returns them: the pools are exactly as before."""
    e = chunky
    ids = list(range(10))
    commit(e, "device", ids)
    if kind == "restore":
        assert isinstance(e.execute(move("evict", "device", "host", ids)), MoveAcked)
    before = snapshot(e)
    table = (e.host_pool if kind == "evict" else e.device_pool).table

    def refuse(block_ids, slots):
        raise RuntimeError("maps could not be written")

    monkeypatch.setattr(table, "record_reserved", refuse)
    src, dst = ("device", "host") if kind == "evict" else ("host", "device")
    out = e.execute(move(kind, src, dst, ids))
    assert isinstance(out, MoveFailed) and "could not be written" in out.error, out
    assert_same(before, snapshot(e))


def test_warm_up_runs_every_move_path_and_leaves_nothing_behind(chunky, monkeypatch):
    """Mover.warm_up (run by a GPU worker before its Hello): a 1-block spill and restore and one
    a pipeline chunk longer than the first chunk, on scratch ids, then freed. The pools, checksums
    and bytes of the blocks already there are as before; a block can be committed under any id."""
    e = chunky
    data = commit(e, "device", list(range(6)))
    assert isinstance(e.execute(move("evict", "device", "host", [4, 5])), MoveAcked)
    before = snapshot(e)
    real, log = copy_mod.Copier.enqueue, []
    monkeypatch.setattr(copy_mod.Copier, "enqueue", lambda self, lo, hi: (log.append((self.direction, self.mode)),
                                                                         real(self, lo, hi)))
    did = e.warm_up()
    assert did["blocks"] == [1, 3 + 1]              # a first chunk alone, and one chunk past it
    modes = e.ctx.copy_modes                       # staged on CPU, dma on a GPU with batched DMAs
    assert ("d2h", modes["d2h"]) in log and ("h2d", modes["h2d"]) in log and ("d2h", "dma") in log
    assert_same(before, snapshot(e))
    e.check_integrity()
    assert isinstance(e.execute(move("restore", "host", "device", [4, 5])), MoveAcked)
    for b in range(6):
        assert torch.equal(words_of(e, "device", b), data[b])


def test_a_move_of_several_chunks_says_nearly_done_once_before_its_last_chunk_lands(chunky):
    """The worker's MoveNearlyDone comes from ``MoveContext.on_nearly_done``: called once per
    move of several chunks, with the bytes of its last chunk, after the others crossed and before
    the move's bytes are seen landed; never for a move of one chunk; a hook that raises changes
    nothing about the move."""
    e = chunky
    bb = e.ctx.layout.block_bytes
    data = commit(e, "device", list(range(12)))
    told = []
    etas = []
    e.ctx.on_nearly_done = lambda mid, left, eta: (told.append((mid, left, dict(e._inflight[mid].phases))),
                                                   etas.append(eta))
    out = e.execute(move("evict", "device", "host", range(10), move_id="spill-10"))
    assert isinstance(out, MoveAcked)
    # chunks of 3, 3, 3, 1 (the first chunk: 3 plain DMAs): the last is one block
    assert [(m, left) for m, left, _ in told] == [("spill-10", bb)]
    assert "landed" not in told[0][2] and "enqueued" in told[0][2]
    assert etas[0] > 0           # one block at the rate of the nine before it
    told.clear()
    assert isinstance(e.execute(move("restore", "host", "device", [7, 2, 9, 0, 4, 1, 8, 3, 6, 5],
                                     move_id="restore-10")), MoveAcked)
    assert [(m, left) for m, left, _ in told] == [("restore-10", bb)]
    assert "landed" not in told[0][2]
    told.clear()
    assert isinstance(e.execute(move("evict", "device", "host", [10, 11])), MoveAcked)
    assert told == [], "one chunk: nothing to say before the ack"

    def broken(mid, left, eta):
        raise RuntimeError("listener gone")
    e.ctx.on_nearly_done = broken
    assert isinstance(e.execute(move("evict", "device", "host", range(10))), MoveAcked)
    e.ctx.on_nearly_done = None
    for b in range(12):
        assert torch.equal(words_of(e, "host", b), data[b])
