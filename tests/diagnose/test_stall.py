from residency.events import catalog as ev
from residency.control.diagnose import DiagnoseParams, detect_holes, detect_stalls
from tests.diagnose.ledgers import SECOND


def test_requests_waiting_with_no_step_and_no_acked_move_are_a_stall_even_while_everyone_talks(L):
    L.worker(0)
    last_step = L.step(0, 1)
    admitted = [L.admit()[1] for _ in range(L.rng.randrange(1, 5))]
    # every process alive: checkpoints, heartbeat noise, refusals -- none of it is progress
    L.chatter(6)
    L.add(ev.MoveRefused(ask="policy:spill", worker=0, tier="host", asked_bytes=1 << 20, available_bytes=0,
                         floor_bytes=0, reason="host has no room"))
    L.chatter(9)
    [f] = detect_stalls(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.onset_ns == admitted[0].envelope.ts_ns
    assert {r.seq for r in admitted} <= set(f.seqs) and last_step.seq in f.seqs
    assert f.detail["num_requests"] == len(admitted)


def test_a_stall_that_ended_with_a_step_is_reported_with_its_duration(L):
    L.worker(0)
    L.admit()
    L.chatter(12)
    resumed = L.step(0, 7)
    L.step(0, 8, dt_ms=500)
    [f] = detect_stalls(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns == resumed.envelope.ts_ns
    assert resumed.seq in f.seqs
    assert "other events recorded meanwhile" in f.title


def test_steady_steps_while_requests_wait_are_not_a_stall(L):
    L.worker(0)
    for _ in range(3):
        L.admit()
    for i in range(60):
        L.step(0, i, dt_ms=900)
    assert detect_stalls(L.events, at_ns=L.now) == []


def test_an_idle_server_with_no_requests_is_not_stalled(L):
    L.worker(0)
    rid, _ = L.admit()
    L.step(0, 1)
    L.finish(rid)
    L.chatter(120)
    assert detect_stalls(L.events, at_ns=L.now + 600 * SECOND) == []


def test_the_stall_threshold_is_a_parameter(L):
    L.worker(0)
    L.admit()
    L.chatter(4)
    assert detect_stalls(L.events, at_ns=L.now) == []
    assert len(detect_stalls(L.events, at_ns=L.now, params=DiagnoseParams(stall_after_ns=3 * SECOND))) == 1


def test_device_bytes_freed_and_left_unclaimed_while_requests_wait_are_a_hole(L):
    L.worker(0)
    blocks = L.commit(0, L.rng.randrange(4, 20))
    waiting = [L.admit()[1] for _ in range(2)]
    freed = L.free(0, blocks)
    L.step(0, 1)                     # steps go on; nothing is allocated into the freed pages
    L.chatter(8)
    claim = L.commit(0, 2)           # claimed at last
    [f] = detect_holes(L.events, at_ns=L.now)
    assert f.onset_ns == freed.envelope.ts_ns
    assert f.until_ns == L.events[-1].envelope.ts_ns
    assert f.detail["freed_bytes"] == len(blocks) * L.block_bytes[0]
    assert freed.seq in f.seqs and waiting[0].seq in f.seqs
    assert claim  # (the claim closes the episode)


def test_freed_bytes_claimed_at_once_are_not_a_hole(L):
    L.worker(0)
    blocks = L.commit(0, 6)
    L.admit()
    L.free(0, blocks)
    L.commit(0, 3, dt_ms=20)
    L.chatter(30)
    assert detect_holes(L.events, at_ns=L.now) == []


def test_bytes_freed_with_no_one_waiting_are_not_a_hole(L):
    L.worker(0)
    blocks = L.commit(0, 6)
    L.free(0, blocks)
    L.chatter(30)
    L.admit()
    L.commit(0, 1)
    assert detect_holes(L.events, at_ns=L.now) == []


def test_an_evicting_move_frees_device_bytes_too(L):
    L.worker(0)
    blocks = L.commit(0, 5)
    L.admit()
    L.move(0, "evict", "device", "host", blocks)
    L.chatter(10)
    [f] = detect_holes(L.events, at_ns=L.now)
    assert f.until_ns is None and f.detail["freed_bytes"] == 5 * L.block_bytes[0]


def test_a_stall_behind_a_long_queue_keeps_its_key_rows_in_a_capped_proof(L):
    L.worker(0)
    last_step = L.step(0, 1)
    for _ in range(L.rng.randrange(40, 80)):
        L.admit(dt_ms=10)
    L.chatter(12)
    resumed = L.step(0, 2)
    [f] = detect_stalls(L.events, at_ns=L.now)
    assert len(f.seqs) <= 32
    assert last_step.seq in f.seqs and resumed.seq in f.seqs
    assert f.detail["num_requests"] >= 40
