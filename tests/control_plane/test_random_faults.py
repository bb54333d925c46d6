"""10,000 moves with random faults: the control process in this process, one real worker process
whose acks are dropped, delayed, duplicated and reordered and whose releases are sometimes silent
or report 0. At the end the ledger replays with every invariant, and the worker's own memory
(its Inventory) holds exactly the copies the ledger says it holds."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import threading

import pytest

from residency.control.moves import MoveConfig
from residency.events import catalog as ev
from residency.events.commands import Inventory, QueryInventory
from residency.events.asks import AskCommitBlocks, AskMove, AskReleaseBlocks

from tests.control_plane.conftest import (  # noqa: E402
    SMALL_BLOCK, check_ledger, joined, spawn, wait_for, worker_argv,
)

pytestmark = pytest.mark.slow
NUM_MOVES = 10_000
FAULTS = ("drop_ack=0.01,delay_ack=0.02:400,duplicate_ack=0.03,reorder_ack=0.03,"
          "silent_release=0.2,zero_release=0.2,seed={seed}")


def inventory(proc, timeout=10.0) -> Inventory:
    got: list[Inventory] = []
    done = threading.Event()

    def on_inventory(link, msg):
        got.append(msg)
        done.set()

    proc.call(lambda p: (p.on_worker_message(Inventory, on_inventory), p.send_to_worker(0, QueryInventory(nonce=1))))
    assert done.wait(timeout), "no Inventory from the worker"
    return got[0]


@pytest.mark.parametrize("mover", ["real"])
def test_ten_thousand_moves_with_random_faults_keep_every_invariant(make_control, sqlite_url, short_dir, tmp_path,
                                                                      rng, mover):
    proc, store = make_control(sqlite_url, moves=MoveConfig(deadline_base_s=2.0, deadline_bytes_per_s=1e8),
                               deadline_grace_s=0.5,
                               requery_interval_s=0.3, checkpoint_every_events=2000, expected_workers=[0],
                               worker_lost_s=30, heartbeat_missed_s=30)
    seed = rng.randrange(1 << 30)
    worker = spawn(worker_argv(0, f"ipc://{short_dir}/w.sock", short_dir, mover=mover,
                               faults=FAULTS.format(seed=seed), device_blocks=256, host_blocks=512, disk_blocks=1024),
                   tmp_path / "worker.log")
    try:
        wait_for(lambda: joined(proc), timeout=90, interval=0.1, what="worker joined")
        ans = proc.submit(AskCommitBlocks(ask_id="c", worker=0, session="s", tier="device", num_blocks=192)).result(30)
        assert ans.error is None, ans
        blocks = list(ans.events[0].blocks)
        requested, submitted = 0, 0
        answers: collections.Counter = collections.Counter()
        pending: set = set()
        snap: dict[int, tuple] = {}
        while requested < NUM_MOVES:
            if submitted % 128 == 0:        # where the blocks are now (asks still race with moves in flight)
                snap = proc.call(lambda p: {b: tuple(st.tiers) for b, st in p.state.blocks.get(0, {}).items()
                                            if b not in p.moves.busy.by_worker.get(0, ())}).result(10)
                if len(snap) < 64:          # blocks freed everywhere come back as new ones
                    proc.submit(AskCommitBlocks(ask_id="more", worker=0, session="s", tier="device", num_blocks=64))
            b = rng.choice(list(snap))
            tiers = snap[b]
            options = []
            if "device" in tiers and "host" not in tiers:
                options += [("evict", {}), ("spill", {})]
            if "device" not in tiers:
                options += [("restore", {})] * 2
            if "host" in tiers and "disk" not in tiers:
                options.append(("demote", {}))
            if "disk" in tiers and "host" not in tiers:
                options.append(("promote", {}))
            if len(tiers) > 1:
                options.append(("release", {"tier": rng.choice(tiers)}))
            kind, extra = rng.choice(options or [("restore", {})])
            if kind == "release":
                ask = AskReleaseBlocks(ask_id=f"x{submitted}", worker=0, tier=extra["tier"], blocks=[b], reason="test")
            else:
                ask = AskMove(ask_id=f"x{submitted}", kind=kind, worker=0, blocks=[b])
            pending.add(proc.submit(ask))
            submitted += 1
            if len(pending) >= 128:
                done, pending = cf.wait(pending, timeout=60, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    a = fut.result()
                    requested += len(a.move_ids)
                    answers[a.error or (type(a.events[0]).__name__ if a.events else "none")] += 1
        for fut in pending:
            fut.result(60)
        # quiescence: nothing in flight, and every stranding the worker can answer for is re-accounted
        wait_for(lambda: proc.call(lambda p: not p.state.inflight).result(10), timeout=60, what="no move in flight")
        # every stranding is re-accounted by a late ack, closed by its worker's rejection or failure
        # (MoveLateFailed), or answered "never received" (not recorded: those stay listed)
        wait_for(lambda: proc.call(lambda p: set(p.state.stranded) <= p.moves.answered_stranded).result(10), timeout=30,
                 what="strandings settled")
        never_received = proc.call(lambda p: set(p.state.stranded)).result(10)
        inv = inventory(proc)
        state = proc.call(lambda p: p.state).result(10)
        for tier in ("device", "host", "disk"):
            ledger_blocks = sorted(b for b, st in state.blocks.get(0, {}).items() if tier in st.tiers)
            assert inv.blocks[tier] == ledger_blocks, tier
            assert inv.used_bytes[tier] == state.tier(0, tier).used_bytes == len(ledger_blocks) * SMALL_BLOCK
        proc.stop("test done")
    finally:
        proc.stop("test done")
        worker.kill()
        worker.wait(10)
    state = check_ledger(store)
    counts = collections.Counter(type(r.event).__name__ for r in store.read())
    stranded_ids = {r.event.move_id for r in store.read() if type(r.event) is ev.MoveStranded}
    late_releases = sum(1 for r in store.read() if type(r.event) is ev.CopiesReleased and r.event.move_id in stranded_ids)
    assert counts["MoveRequested"] >= NUM_MOVES
    assert counts["MoveStranded"] > 0
    assert counts["MoveLateAcked"] + late_releases + counts["MoveLateFailed"] == counts["MoveStranded"] - len(never_received)
    assert set(state.stranded) == never_received
    assert counts["StateCheckpoint"] >= 5
    zero = [r.event for r in store.read() if type(r.event) is ev.CopiesReleased and r.event.bytes == 0]
    assert zero, "no release reported 0 (the fault should have fired)"
    print(dict(counts), dict(answers))
