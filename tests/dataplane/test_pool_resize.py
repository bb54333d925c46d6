"""The device pool resized live: the slot table's relocation plan, the bytes kept across a shrink
and a grow, the refusals with their arithmetic, and the rebind of the pool's readers (all or none)."""
from __future__ import annotations

import random

import pytest
import torch

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.pools import (
    DevicePool, IntegrityError, ReaderRefused, ResizeRefused, SlotTable, TornPool,
)
from residency.dataplane.pools.memory import mem_available_bytes
from residency.dataplane.rebind import Rebinder
from residency.dataplane.worker import WorkerCore
from residency.events.catalog import MoveAcked, MoveRejected
from residency.events.commands import CommitBlocks, PoolRebound, ResizePool
from tests.dataplane.helpers_dataplane import LAYOUT, commit, make_mover, move, release, words_of

_n = [0]


def resize_cmd(num_slots: int, to_gen: int, tier: str = "device") -> ResizePool:
    _n[0] += 1
    return ResizePool(rebind_id=f"rb{_n[0]}", tier=tier, num_slots=num_slots, to_gen=to_gen, deadline_ns=0)


def device_bytes(mover) -> dict[int, torch.Tensor]:
    return {b: words_of(mover, "device", b) for b in mover.device_pool.blocks()}


# ---------------------------------------------------------------- the slot table
def test_a_shrink_moves_every_block_past_the_new_end_into_a_free_slot_below_it():
    t = SlotTable("device", 8, 100)
    t.allocate([10, 11, 12, 13, 14, 15, 16])          # slots 0..6
    t.free([11, 13])                                   # holes at 1 and 3
    plan = t.plan_resize(5)
    assert (plan.blocks, plan.src, plan.dst) == ((15, 16), (5, 6), (1, 3))
    t.resize(plan)
    t.check_integrity()
    assert t.num_slots == 5 and t.num_free == 0
    assert {b: t.slot_of(b) for b in (10, 12, 14, 15, 16)} == {10: 0, 12: 2, 14: 4, 15: 1, 16: 3}


def test_a_shrink_that_the_live_blocks_do_not_fit_is_refused_with_the_arithmetic_and_changes_nothing():
    t = SlotTable("device", 8, 100)
    t.allocate([1, 2, 3, 4, 5, 6])
    before = (dict(t._slot), sorted(t._free), t.num_slots)
    refused = t.plan_resize(4)
    assert isinstance(refused, ResizeRefused)
    assert (refused.asked_slots, refused.asked_bytes, refused.live_blocks) == (4, 400, 6)
    assert "6 live blocks do not fit in 4 slots: 2 over" in str(refused) and "600 B held > 400 B asked" in str(refused)
    assert (dict(t._slot), sorted(t._free), t.num_slots) == before


def test_a_resize_is_refused_while_a_block_is_arriving():
    t = SlotTable("device", 8, 100)
    t.allocate([1])
    t.reserve([2])
    refused = t.plan_resize(8)
    assert isinstance(refused, ResizeRefused) and "arriving (a move in flight)" in str(refused)


def test_a_grow_appends_free_slots_and_relocates_nothing():
    t = SlotTable("device", 3, 100)
    t.allocate([1, 2, 3])
    plan = t.plan_resize(6)
    assert plan.blocks == ()
    t.resize(plan)
    t.check_integrity()
    assert t.num_free == 3 and t.allocate([4, 5]) == [3, 4]


def test_a_stale_plan_is_refused():
    t = SlotTable("device", 6, 100)
    t.allocate([1, 2, 3, 4, 5])
    t.free([1])
    plan = t.plan_resize(4)
    t.free([5])                                        # the table moved on since the plan
    with pytest.raises(IntegrityError, match="stale resize plan"):
        t.resize(plan)


def test_random_allocs_frees_and_resizes_keep_every_block_and_the_integrity():
    rng = random.Random(7)
    t = SlotTable("device", 16, 10)
    live: set[int] = set()
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.45 and t.num_free:
            ids = list(range(next_id, next_id + rng.randint(1, t.num_free)))
            next_id += len(ids)
            t.allocate(ids)
            live.update(ids)
        elif op < 0.75 and live:
            gone = rng.sample(sorted(live), rng.randint(1, len(live)))
            t.free(gone)
            live.difference_update(gone)
        else:
            n = rng.randint(0, 40)
            before = {b: t.slot_of(b) for b in live}
            plan = t.plan_resize(n)
            if len(live) > n:
                assert isinstance(plan, ResizeRefused) and plan.live_blocks == len(live)
                continue
            t.resize(plan)
            moved = dict(zip(plan.blocks, plan.dst))
            assert {b: t.slot_of(b) for b in live} == {b: moved.get(b, s) for b, s in before.items()}
        t.check_integrity()
        assert set(t.ready_blocks()) == live


# ---------------------------------------------------------------- the pool and its readers
def test_a_shrink_then_a_grow_keeps_every_live_block_byte_for_byte(tmp_path, mover_device):
    with make_mover(tmp_path, device=mover_device, device_blocks=12) as m:
        commit(m, "device", list(range(1, 11)))
        release(m, "device", [1, 3, 4, 6])               # holes below the new end
        kept = device_bytes(m)
        rb = Rebinder(m, 0)
        out = rb.resize(resize_cmd(7, 1))
        assert out.error == "" and (out.from_slots, out.to_slots, out.from_gen, out.to_gen) == (12, 7, 0, 1)
        assert (out.from_bytes, out.to_bytes) == (12 * LAYOUT.block_bytes, 7 * LAYOUT.block_bytes)
        assert out.blocks_relocated == 3                  # blocks 8, 9, 10 sat in slots 7..9
        assert out.stamps == {"mover": 1, "staging": 1} and out.refused == {}
        assert m.device_pool.tensor.shape[0] == 7 and m.device_pool.gen == 1
        assert {b: torch.equal(w, kept[b]) for b, w in device_bytes(m).items()} == dict.fromkeys(kept, True)
        m.check_integrity()
        grown = rb.resize(resize_cmd(40, 2))              # past the host's 10 slots: the scratch grows too
        assert grown.error == "" and grown.to_slots == 40 and grown.blocks_relocated == 0
        assert all(up.capacity >= 80 for up in m.tiers.indexes.values()) and m.tiers.landing.capacity >= 40
        assert {b: torch.equal(w, kept[b]) for b, w in device_bytes(m).items()} == dict.fromkeys(kept, True)
        new = commit(m, "device", list(range(100, 130)))     # the grown pool takes blocks, and moves them
        ack = m.execute(move("evict", "device", "host", [2, 5, 7, 8, 9, 10, 100]))
        assert isinstance(ack, MoveAcked) and ack.checksum_ok
        assert torch.equal(words_of(m, "host", 10), kept[10]) and torch.equal(words_of(m, "host", 100), new[100])
        m.check_integrity()


def test_on_cpu_the_driver_figure_is_not_measured_and_on_cuda_it_is(tmp_path, mover_device):
    with make_mover(tmp_path, device=mover_device, device_blocks=12) as m:
        out = Rebinder(m, 0).resize(resize_cmd(4, 1))
        if mover_device == "cpu":
            assert out.measured_freed_bytes is None and out.allocator_freed_bytes is None
        else:
            assert out.measured_freed_bytes is not None and out.allocator_freed_bytes is not None


def test_a_resize_is_refused_while_a_move_is_in_flight(tmp_path):
    with make_mover(tmp_path, device_blocks=12) as m:
        commit(m, "host", [1, 2])
        ticket = m.submit(move("restore", "host", "device", [1, 2]))
        out = Rebinder(m, 0).resize(resize_cmd(6, 1))
        assert "1 moves in flight" in out.error and out.to_slots == 12 and m.device_pool.gen == 0
        assert isinstance(m.wait(ticket), MoveAcked)
        assert m.device_pool.table.plan_resize(6).blocks == ()           # slots 0 and 1: nothing to relocate
        assert Rebinder(m, 0).resize(resize_cmd(6, 1)).error == ""


def test_a_shrink_the_live_blocks_do_not_fit_is_answered_with_the_arithmetic(tmp_path):
    with make_mover(tmp_path, device_blocks=12) as m:
        data = commit(m, "device", list(range(9)))
        out = Rebinder(m, 0).resize(resize_cmd(5, 1))
        assert "9 live blocks do not fit in 5 slots: 4 over" in out.error
        assert (out.to_slots, out.stamps, m.device_pool.gen, m.device_pool.num_slots) == (12, {}, 0, 12)
        assert all(torch.equal(words_of(m, "device", b), w) for b, w in data.items())


def test_a_grow_beyond_the_machine_is_refused_with_the_arithmetic_before_anything_changes(tmp_path):
    with make_mover(tmp_path, device_blocks=12) as m:
        commit(m, "device", [1, 2, 3])
        huge = 2 * mem_available_bytes() // LAYOUT.block_bytes
        out = Rebinder(m, 0).resize(resize_cmd(huge, 1))
        assert f"the new tensor of {huge} x {LAYOUT.block_bytes} B = {huge * LAYOUT.block_bytes} B does not fit" \
            in out.error and "MemAvailable" in out.error
        assert m.device_pool.num_slots == 12 and m.device_pool.gen == 0 and out.stamps == {}
        m.check_integrity()


def test_a_grow_whose_slot_scratch_the_pinned_budget_cannot_fund_is_refused_before_anything_changes(tmp_path):
    with make_mover(tmp_path, device_blocks=12) as m:
        out = Rebinder(m, 0).resize(resize_cmd(2000, 1))
        assert "the slot scratch of 2000 slots needs" in out.error and "pinned budget refuses" in out.error
        assert m.device_pool.num_slots == 12 and m.device_pool.gen == 0
    with make_mover(tmp_path / "b", device_blocks=12, budget_slack=1 << 20) as m:    # funded: it grows
        out = Rebinder(m, 0).resize(resize_cmd(2000, 1))
        assert out.error == "" and m.tiers.indexes["d2h"].capacity == 4000 and m.tiers.landing.capacity == 2000
        m.check_integrity()


def test_a_generation_that_does_not_move_forward_is_refused(tmp_path):
    with make_mover(tmp_path) as m:
        rb = Rebinder(m, 0)
        assert rb.resize(resize_cmd(12, 3)).error == ""
        assert "to_gen 3 does not move forward from gen 3" in rb.resize(resize_cmd(12, 3)).error


def test_a_resize_sent_again_is_answered_again_and_runs_once(tmp_path):
    with make_mover(tmp_path) as m:
        rb = Rebinder(m, 0)
        cmd = resize_cmd(6, 1)
        first = rb.handle(cmd)
        assert rb.handle(cmd) == first and first[0].error == "" and m.device_pool.gen == 1


def test_a_reader_of_the_wrong_shape_refuses_to_bind_and_is_not_registered(tmp_path):
    from residency.dataplane.rebind import MoverReader
    from residency.dataplane.pools import KVLayout
    other = KVLayout(num_layers=3, page_tokens=8, num_kv_heads=2, head_dim=6, dtype=torch.bfloat16)
    with make_mover(tmp_path) as m:
        foreign = DevicePool(other, 4)
        reader = MoverReader(m)
        with pytest.raises(ReaderRefused, match="not the pool this mover's moves address"):
            reader.bind(foreign, 1)
        assert reader.gen == -1 and "mover" not in foreign.readers
        with pytest.raises(ReaderRefused, match=r"pool blocks are \(3, 2, 8, 2, 6\), this reader reads \(3, 2, 5, 2, 6\)"):
            m.device_pool.tensor = foreign.tensor      # the same pool object holding another model's pages
            reader.bind(m.device_pool, 1)


# ---------------------------------------------------------------- a torn rebind, then its repair
def test_a_missed_stamp_tears_the_pool_moves_are_refused_by_name_and_a_rebind_in_place_repairs_it(tmp_path):
    with make_mover(tmp_path, device_blocks=12) as m:
        data = commit(m, "device", [1, 2, 3])
        core = WorkerCore(m, 0, WorkerFaults("miss_stamp=staging"))
        (torn,) = core.run(resize_cmd(8, 1))
        assert type(torn) is PoolRebound and torn.error == "" and torn.stamps == {"mover": 1}
        assert m.device_pool.behind() == {"staging": 0}
        (refused,) = core.run(move("evict", "device", "host", [1]))
        assert type(refused) is MoveRejected
        assert "torn pool: device pool at gen 1 has readers behind (staging at gen 0)" in refused.reason
        with pytest.raises(TornPool):
            m.commit_blocks(CommitBlocks(request_id="c", session=None, tier="device", blocks=[9], seed=5))
        assert isinstance(m.execute(move("spill", "host", "disk", [])), (MoveAcked, MoveRejected))  # no device: not torn
        (repaired,) = core.run(resize_cmd(8, 2))         # the same size: a rebind in place
        assert repaired.error == "" and repaired.stamps == {"mover": 2, "staging": 2}
        assert repaired.blocks_relocated == 0 and m.device_pool.behind() == {}
        assert core.pool_status() == (2, ["mover", "staging"])
        ack = m.execute(move("evict", "device", "host", [1, 2, 3]))
        assert isinstance(ack, MoveAcked) and all(torch.equal(words_of(m, "host", b), data[b]) for b in data)
        m.check_integrity()


def test_the_miss_stamp_fault_is_one_shot_and_must_name_a_reader():
    f = WorkerFaults("miss_stamp=serving")
    assert f.enabled and f.take_miss_stamp() == "serving" and f.take_miss_stamp() is None
    with pytest.raises(ValueError, match="needs a reader"):
        WorkerFaults("miss_stamp=")


def test_a_worker_without_a_resizable_pool_answers_resize_with_an_error():
    class NoPool:
        pass
    (out,) = WorkerCore(NoPool(), 3).run(resize_cmd(8, 1))
    assert out.worker == 3 and "no resizable device pool" in out.error


def test_captured_graphs_bind_a_rebind_in_place_and_refuse_a_new_tensor(tmp_path):
    from residency.dataplane.model.graphs import DecodeGraphs
    with make_mover(tmp_path, device_blocks=12) as m:
        graphs = object.__new__(DecodeGraphs)            # capture needs CUDA: only the pool it captured on
        graphs.pool = m.device_pool.tensor
        m.device_pool.add_reader(graphs)
        rb = Rebinder(m, 0)
        in_place = rb.resize(resize_cmd(12, 1))
        assert in_place.stamps == {"mover": 1, "staging": 1, "graphs": 1}
        moved = rb.resize(resize_cmd(8, 2))
        assert moved.stamps == {"mover": 2, "staging": 2} and "recapture after a rebind" in moved.refused["graphs"]
        assert m.device_pool.behind() == {"graphs": 1}
        assert "graphs at gen 1" in m.execute(move("evict", "device", "host", [])).reason
