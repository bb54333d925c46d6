"""A real worker process (real mover, real ZMQ) answers ResizePool with PoolRebound: Hello names
its pool's generation and readers, a missed stamp tears the pool (a move refused by name), and a
shrink that relocates blocks repairs it with every byte kept."""
from __future__ import annotations

from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, BlocksWritten, CommitBlocks, ExecuteMove, Hello, PoolRebound, ReleaseBlocks, ResizePool, Shutdown,
)
from tests.control_plane.conftest import SMALL_BLOCK, short_dir, spawn, worker_argv  # noqa: F401 - a fixture
from tests.control_plane.test_worker import Control


def evict(move_id: str, blocks: list[int]) -> ExecuteMove:
    return ExecuteMove(move_id=move_id, kind="spill", src="device", dst="host", blocks=blocks, keep_source=True,
                       deadline_ns=0)


def test_a_worker_process_resizes_its_pool_tears_on_a_missed_stamp_and_repairs_on_the_next_rebind(short_dir, tmp_path):
    endpoint = f"ipc://{short_dir}/w.sock"
    ctl = Control(endpoint, use_lane=True)
    w = spawn(worker_argv(0, endpoint, short_dir, device_blocks=16, faults="miss_stamp=staging"), tmp_path / "w.log")
    try:
        hello = ctl.expect(Hello, timeout=60)
        assert (hello.pool_gen, hello.readers) == (0, ["mover", "staging"])
        ctl.send(CommitBlocks(request_id="c", session=None, tier="device", blocks=list(range(1, 11)), seed=1234))
        assert ctl.expect(BlocksWritten).blocks == list(range(1, 11))
        ctl.send(evict("m-1", [8, 9, 10]))
        sums_before = ctl.expect(ev.MoveAcked).checksums                 # blocks 8..10 measured in slots 7..9
        ctl.send(ReleaseBlocks(release_id="r-1", tier="device", blocks=[1, 2, 3, 4]))
        assert ctl.expect(BlocksReleased).bytes_freed == 4 * SMALL_BLOCK
        ctl.send(ResizePool(rebind_id="rb-1", tier="device", num_slots=16, to_gen=1, deadline_ns=0))
        torn = ctl.expect(PoolRebound)
        assert torn.error == "" and torn.stamps == {"mover": 1} and torn.refused == {}
        ctl.send(evict("m-2", [5]))
        refused = ctl.expect(ev.MoveRejected)
        assert "torn pool" in refused.reason and "staging at gen 0" in refused.reason
        ctl.send(ResizePool(rebind_id="rb-2", tier="device", num_slots=6, to_gen=2, deadline_ns=0))
        done = ctl.expect(PoolRebound)
        assert done.error == "" and done.stamps == {"mover": 2, "staging": 2}
        assert (done.from_slots, done.to_slots, done.from_bytes, done.to_bytes) == (16, 6, 16 * SMALL_BLOCK, 6 * SMALL_BLOCK)
        assert done.blocks_relocated == 4 and done.measured_freed_bytes is None      # a CPU worker: not measured
        assert done.finished_ns >= done.started_ns > 0
        ctl.send(ExecuteMove(move_id="m-3", kind="evict", src="device", dst="disk", blocks=[8, 9, 10],
                             keep_source=False, deadline_ns=0))
        moved = ctl.expect(ev.MoveAcked)
        assert moved.checksum_ok and moved.checksums == sums_before                # relocated byte for byte
        ctl.send(ResizePool(rebind_id="rb-3", tier="device", num_slots=2, to_gen=3, deadline_ns=0))
        too_small = ctl.expect(PoolRebound)
        assert "3 live blocks do not fit in 2 slots: 1 over" in too_small.error and too_small.to_slots == 6
        ctl.send(Shutdown(reason="test"))
        assert w.wait(30) == 0
    finally:
        w.kill()
        ctl.sock.close(0)
