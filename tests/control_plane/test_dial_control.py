"""The dial on a real control process (real ledger, real ZMQ), its worker scripted: what the
ledger records for a resize, and what a torn or rebinding pool refuses."""
from __future__ import annotations

from residency.events import catalog as ev
from residency.events.asks import AskMove, AskResize, AskSetBudget
from residency.events.commands import ExecuteMove, Hello, PoolRebound, ReleaseBlocks, ResizePool, BlocksReleased

from tests.control_plane.conftest import check_ledger, commit_blocks, events_of, joined, wait_for

BB = 4096
READERS = ["serving", "mover"]


def join(make_control, fake_worker, url, **over):
    proc, store = make_control(url, **over)
    fw = fake_worker(block_bytes=BB, tiers={"device": 16 * BB, "host": 64 * BB, "disk": 0})
    fw.send(Hello(worker=0, epoch=1, device="cpu", tiers=fw.tiers, block_bytes=BB, pool_gen=0, readers=READERS))
    wait_for(lambda: joined(proc), what="worker joined")
    return proc, store, fw


def rebound(cmd: ResizePool, stamps=None, error="", from_slots=16) -> PoolRebound:
    return PoolRebound(rebind_id=cmd.rebind_id, worker=0, tier="device", from_gen=cmd.to_gen - 1, to_gen=cmd.to_gen,
                       from_slots=from_slots, to_slots=cmd.num_slots, from_bytes=from_slots * BB,
                       to_bytes=cmd.num_slots * BB,
                       stamps={r: cmd.to_gen for r in READERS} if stamps is None else stamps,
                       measured_freed_bytes=None, error=error)


def answer_moves(fw, n_expected: int) -> None:
    """Ack the moves out (ExecuteMove) and releases the control sends, until n blocks left."""
    left = n_expected
    while left > 0:
        cmd = fw.recv()
        if type(cmd) is ExecuteMove:
            fw.send(fw.ack(cmd))
        else:
            assert type(cmd) is ReleaseBlocks, cmd
            fw.send(BlocksReleased(release_id=cmd.release_id, worker=0, tier=cmd.tier, blocks=cmd.blocks,
                                   bytes_freed=len(cmd.blocks) * BB))
        left -= len(cmd.blocks)


def types(ans) -> list[str]:
    return [type(e).__name__ for e in ans.events]


def test_a_shrink_moves_the_coldest_blocks_out_then_rebinds_every_reader_write_ahead(make_control, fake_worker,
                                                                                      sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    blocks = commit_blocks(proc, fw, 10)
    fut = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=6 * BB + 100))
    answer_moves(fw, 4)
    cmd = fw.expect(ResizePool)
    assert cmd.num_slots == 6 and cmd.to_gen == 1
    # write-ahead: the rebind is in the ledger before its command reached the worker
    req = [r.event for r in events_of(store, ev.RebindRequested)]
    assert [(e.rebind_id, e.from_gen, e.to_gen, e.readers) for e in req] == [(cmd.rebind_id, 0, 1, READERS)]
    fw.send(rebound(cmd))
    ans = fut.result(10)
    assert ans.error is None
    t = types(ans)
    assert t.count("MoveAcked") == 1 and t[-5:] == ["RebindRequested", "ReaderStamped", "ReaderStamped",
                                                    "PoolResized", "RebindCommitted"]
    resized = [e for e in ans.events if type(e) is ev.PoolResized][0]
    assert (resized.from_bytes, resized.to_bytes, resized.gen, resized.measured_freed_bytes) == (16 * BB, 6 * BB, 1, None)
    state = check_ledger(store)
    assert state.workers[0].tiers["device"].capacity_bytes == 6 * BB
    on_device = [b for b in blocks if "device" in state.blocks[0][b].tiers]
    assert on_device == blocks[4:]          # the four coldest left the device; their host copies stay
    assert all("host" in state.blocks[0][b].tiers for b in blocks[:4])


def test_below_the_floor_is_refused_with_its_arithmetic_and_nothing_changes(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    commit_blocks(proc, fw, 4)
    assert proc.submit(AskSetBudget(ask_id="b", worker=0, tier="device", floor_bytes=3 * BB,
                                    ceiling_bytes=0)).result(5).error is None
    ans = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=2 * BB)).result(5)
    assert types(ans) == ["MoveRefused"]
    e = ans.events[0]
    assert (e.ask, e.asked_bytes, e.floor_bytes, e.available_bytes) == ("api:resize", 2 * BB, 3 * BB, 16 * BB)
    assert "budget floor 12288" in e.reason
    assert fw.quiet(0.3) == []              # nothing moved, no rebind sent
    assert not events_of(store, ev.RebindRequested, ev.MoveRequested)
    assert check_ledger(store).workers[0].tiers["device"].capacity_bytes == 16 * BB


def test_another_tier_is_not_a_resize(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    ans = proc.submit(AskResize(ask_id="r1", worker=0, tier="host", bytes=8 * BB)).result(5)
    assert ans.error == "invalid_ask" and "only the device pool" in ans.detail and ans.events == []


def test_a_resize_while_another_runs_is_refused_whole(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    first = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=8 * BB))
    cmd = fw.expect(ResizePool)
    second = proc.submit(AskResize(ask_id="r2", worker=0, tier="device", bytes=4 * BB)).result(5)
    assert types(second) == ["MoveRefused"] and cmd.rebind_id in second.events[0].reason
    fw.send(rebound(cmd))
    assert types(first.result(5))[-1] == "RebindCommitted"


def test_a_missed_stamp_tears_the_pool_until_a_complete_resize_repairs_it(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    commit_blocks(proc, fw, 3, session="s")
    fut = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=12 * BB))
    cmd = fw.expect(ResizePool)
    fw.send(rebound(cmd, stamps={"serving": cmd.to_gen}))        # the mover missed its stamp
    ans = fut.result(5)
    torn = ans.events[-1]
    assert type(torn) is ev.RebindTorn and torn.readers_behind == ["mover"]
    # the pool takes no move, with a reason naming the rebind, and health says so
    park = proc.submit(AskMove(ask_id="p", kind="park", worker=0, session="s")).result(5)
    assert types(park) == ["MoveRefused"] and cmd.rebind_id in park.events[0].reason
    assert "pool_torn" in park.events[0].reason
    wait_for(lambda: any(cmd.rebind_id in p for p in proc.health().problems), what="health names the torn pool")
    assert not proc.health().healthy
    # the same size again: a rebind in place, which repairs it
    fut = proc.submit(AskResize(ask_id="r2", worker=0, tier="device", bytes=12 * BB))
    cmd2 = fw.expect(ResizePool)
    assert cmd2.to_gen == cmd.to_gen + 1
    fw.send(rebound(cmd2, from_slots=12))
    assert types(fut.result(5))[-1] == "RebindCommitted"
    wait_for(lambda: proc.health().healthy, what="healthy again")
    park = proc.submit(AskMove(ask_id="p2", kind="park", worker=0, session="s"))
    fw.send(fw.ack(fw.expect(ExecuteMove)))
    assert types(park.result(5))[0] == "MoveAcked"
    check_ledger(store)


def test_a_worker_refusal_closes_the_rebind_with_nothing_changed(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    fut = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=1 << 40))
    cmd = fw.expect(ResizePool)
    fw.send(rebound(cmd, error="asked 1099511627776 bytes > 8589934592 free on the card"))
    ans = fut.result(5)
    assert types(ans) == ["RebindRequested", "RebindRefused"] and "free on the card" in ans.events[-1].error
    state = check_ledger(store)
    assert state.workers[0].tiers["device"].capacity_bytes == 16 * BB
    assert proc.health().healthy
    # the worker's pool stayed at gen 0: the next rebind asks for gen 1 again... above every gen asked before
    fut = proc.submit(AskResize(ask_id="r2", worker=0, tier="device", bytes=8 * BB))
    assert fw.expect(ResizePool).to_gen == 2


def test_no_answer_by_the_deadline_tears_the_rebind_naming_every_reader(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url, rebind_deadline_s=0.2)
    fut = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=8 * BB))
    fw.expect(ResizePool)
    ans = fut.result(10)
    assert types(ans) == ["RebindRequested", "RebindTorn"] and ans.events[-1].readers_behind == READERS


def test_a_stop_mid_rebind_tears_it_and_answers_the_asker(make_control, fake_worker, sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    fut = proc.submit(AskResize(ask_id="r1", worker=0, tier="device", bytes=8 * BB))
    cmd = fw.expect(ResizePool)
    proc.stop("test stop")
    ans = fut.result(5)
    assert types(ans) == ["RebindRequested", "RebindTorn"] and ans.events[-1].rebind_id == cmd.rebind_id


def test_a_rebind_requested_and_never_answered_before_a_crash_is_torn_at_restart(make_control, fake_worker,
                                                                                 sqlite_url):
    proc, store, fw = join(make_control, fake_worker, sqlite_url)
    # what a control that crashed after its write-ahead leaves: a RebindRequested and nothing after
    lost = ev.RebindRequested(rebind_id="rb-crashed", worker=0, pool="device", from_gen=0, to_gen=1,
                              readers=["scheduler", *READERS])
    proc.call(lambda p: p.record(lost)).result(5)
    wait_for(lambda: events_of(store, ev.RebindRequested), what="the rebind committed")
    proc.stop("test stop")
    store.close()
    proc2, store2 = make_control(sqlite_url)
    torn = [r.event for r in events_of(store2, ev.RebindTorn)]
    assert [(e.rebind_id, e.readers_behind) for e in torn] == [("rb-crashed", sorted(["scheduler", *READERS]))]
    assert any("rb-crashed" in p for p in proc2.health().problems) and not proc2.health().healthy
    check_ledger(store2)
