from residency.events import catalog as ev
from residency.control.diagnose import detect_worker_silence
from tests.diagnose.ledgers import SECOND


def test_a_silent_worker_is_named_with_the_moves_in_flight_on_it(L):
    L.worker(0)
    L.worker(1)
    L.commit(1, 7)
    mid, req = L.request_move(1, "spill", "device", "host", L.commit(1, 3), keep=True, deadline_ms=60_000)
    missed = L.add(ev.WorkerHeartbeatMissed(worker=1, silent_ms=L.rng.randrange(2000, 9000)))
    L.step(0, 1)                    # the other worker is fine
    L.chatter(5)
    [f] = detect_worker_silence(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns is None and f.subject == "worker 1"
    assert f.onset_ns == missed.envelope.ts_ns - missed.event.silent_ms * 1_000_000
    assert {missed.seq, req.seq} <= set(f.seqs)
    assert f.detail["bytes_in_flight"] == 3 * L.block_bytes[1]
    assert f.detail["bytes_resident"] == 10 * L.block_bytes[1]


def test_a_silent_worker_names_the_move_it_froze_on_after_that_move_was_stranded(L):
    L.worker(0)
    blocks = L.commit(0, L.rng.randrange(2, 9))
    mid, req = L.request_move(0, "park", "device", "host", blocks, deadline_ms=500)
    L.chatter(1)
    nbytes = len(blocks) * L.block_bytes[0]
    stranded = L.add(ev.MoveStranded(move_id=mid, worker=0, bytes_at_risk=nbytes, why="deadline"))
    L.add(ev.WorkerHeartbeatMissed(worker=0, silent_ms=3000))
    L.chatter(5)
    [f] = detect_worker_silence(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.detail["bytes_in_flight"] == 0
    assert "1 stranded there" in f.title and mid in f.title
    assert f.detail["bytes_stranded"] == nbytes and f.detail["stranded_moves"] == [mid]
    assert stranded.seq in f.seqs


def test_a_worker_that_answers_after_a_silence_has_an_ended_episode_not_a_warning(L):
    L.worker(0)
    L.add(ev.WorkerHeartbeatMissed(worker=0, silent_ms=3000))
    L.chatter(2)
    back = L.step(0, 4)
    [f] = detect_worker_silence(L.events, at_ns=L.now + 60 * SECOND)
    assert f.severity == "info" and f.until_ns == back.envelope.ts_ns and back.seq in f.seqs


def test_a_lost_worker_is_named_with_the_bytes_stranded_on_it(L):
    L.worker(0)
    L.worker(1)
    bb = L.block_bytes[1]
    blocks = L.commit(1, L.rng.randrange(3, 10))
    m1, _ = L.request_move(1, "spill", "device", "host", blocks[:2], keep=True, deadline_ms=10_000)
    m2, _ = L.request_move(1, "spill", "device", "host", blocks[2:3], keep=True, deadline_ms=10_000)
    lost = L.add(ev.WorkerLost(worker=1, reason="heartbeat silent", blocks_lost=blocks, bytes_lost=len(blocks) * bb))
    s1 = L.add(ev.MoveStranded(move_id=m1, worker=1, bytes_at_risk=2 * bb, why="worker_lost"))
    # m2 never gets an outcome: the ledger's own invariant is broken, and that is named too
    [f] = detect_worker_silence(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.detail["bytes_lost"] == len(blocks) * bb and f.detail["bytes_stranded"] == 2 * bb
    assert f.detail["moves_without_outcome"] == [m2]
    assert {lost.seq, s1.seq} <= set(f.seqs)


def test_a_worker_stopped_with_the_server_whose_disk_copies_were_kept_is_only_an_info(L):
    L.worker(0)
    bb = L.block_bytes[0]
    blocks = L.commit(0, 4)
    L.move(0, "demote", "device", "disk", blocks)
    L.add(ev.ServerStopped(reason="signal SIGTERM"))
    L.add(ev.WorkerLost(worker=0, reason="stopped with the server; epoch 2 replaces 1", kept_on_disk=blocks,
                        bytes_kept=4 * bb))
    L.worker(0)
    [f] = detect_worker_silence(L.events, at_ns=L.now)
    assert f.severity == "info" and "kept by the next incarnation" in f.title
    assert f.detail["bytes_kept_on_disk"] == 4 * bb and f.detail["bytes_lost"] == 0
    assert f.suggestion.startswith("nothing was lost")


def test_a_healthy_worker_is_not_a_finding(L):
    L.worker(0)
    for i in range(20):
        L.step(0, i, dt_ms=100)
        L.move(0, "spill", "device", "host", L.commit(0, 1), keep=True)
    assert detect_worker_silence(L.events, at_ns=L.now + 3600 * SECOND) == []


def test_a_lost_worker_that_rejoined_is_an_ended_episode(L):
    L.worker(0)
    L.add(ev.WorkerLost(worker=0, reason="killed", blocks_lost=[], bytes_lost=0))
    L.chatter(3)
    back = L.add(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 1 << 30}, block_bytes=L.block_bytes[0]))
    [f] = detect_worker_silence(L.events, at_ns=L.now)
    assert f.until_ns == back.envelope.ts_ns and f.severity == "warning"
