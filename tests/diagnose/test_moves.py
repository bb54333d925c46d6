from residency.events import catalog as ev
from residency.control.diagnose import DiagnoseParams, detect_overdue_moves, detect_pendulum
from tests.diagnose.ledgers import MS, SECOND


def test_a_move_in_flight_past_its_deadline_is_a_wedge_naming_what_waits_behind_it(L):
    L.worker(0)
    session = L.uid("s")
    blocks = L.commit(0, L.rng.randrange(2, 9), session=session)
    mid, req = L.request_move(0, "park", "device", "host", blocks, session=session, deadline_ms=100)
    other, _ = L.request_move(0, "spill", "device", "host", L.commit(0, 3), deadline_ms=3_600_000)
    rid, admitted = L.admit(session=session)
    _, unrelated = L.admit(session=L.uid("s"))
    at = req.event.deadline_ns + 7 * SECOND

    [f] = detect_overdue_moves(L.events, at_ns=at)
    assert f.severity == "critical" and f.until_ns is None
    assert f.onset_ns == req.event.deadline_ns
    assert req.seq in f.seqs and admitted.seq in f.seqs and unrelated.seq not in f.seqs
    assert mid in f.title and "past its deadline" in f.title
    assert f.detail["requests_blocked"] == [rid]
    assert f.detail["moves_behind"] == [other]
    assert f.suggestion


def test_a_move_not_yet_at_its_deadline_is_not_a_wedge(L):
    L.worker(0)
    _, req = L.request_move(0, "spill", "device", "host", L.commit(0, 4), deadline_ms=500)
    assert detect_overdue_moves(L.events, at_ns=req.event.deadline_ns - 1) == []


def test_a_move_acked_in_time_is_not_a_wedge_whatever_now_is(L):
    L.worker(0)
    for _ in range(L.rng.randrange(3, 10)):
        L.move(0, "spill", "device", "host", L.commit(0, L.rng.randrange(1, 6)), keep=True)
    assert detect_overdue_moves(L.events, at_ns=L.now + 3600 * SECOND) == []


def test_a_move_acked_long_past_its_deadline_without_a_stranding_shows_a_watchdog_gap(L):
    L.worker(1)
    mid, req = L.request_move(1, "restore", "host", "device", L.commit(1, 3, tier="host"), deadline_ms=50)
    L.wait(4)
    ack = L.ack(mid, 1, 3 * L.block_bytes[1])
    [f] = detect_overdue_moves(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns == ack.envelope.ts_ns
    assert {req.seq, ack.seq} <= set(f.seqs) and mid in f.title and "never stranded" in f.title


def test_stranded_moves_never_late_acked_are_bytes_at_risk_and_late_acks_close_them(L):
    L.worker(0)
    bb = L.block_bytes[0]
    stuck, late = [], []
    for i in range(4):
        mid, req = L.request_move(0, "spill", "device", "host", L.commit(0, 2), keep=True)
        L.wait(0.2)
        s = L.add(ev.MoveStranded(move_id=mid, worker=0, bytes_at_risk=2 * bb, why="deadline"))
        (stuck if i % 2 else late).append((mid, req, s))
    for mid, _, _ in late:
        L.add(ev.MoveLateAcked(move_id=mid, worker=0, bytes_moved=2 * bb, bytes_freed_src=0, checksum_ok=True,
                               started_ns=L.now, finished_ns=L.now))
    found = {f.severity: f for f in detect_overdue_moves(L.events, at_ns=L.now)}
    assert set(found) == {"warning", "info"}
    assert found["warning"].detail["bytes_at_risk"] == 4 * bb and found["warning"].detail["num_moves"] == 2
    assert {s.seq for _, _, s in stuck} <= set(found["warning"].seqs)
    assert found["info"].detail["num_moves"] == 2


def _swing(L, w, blocks, times, gap_s):
    for _ in range(times):
        L.move(w, "evict", "device", "host", blocks)
        L.wait(gap_s)
        L.move(w, "restore", "host", "device", blocks)
        L.wait(gap_s)


def test_blocks_sent_off_the_device_and_back_again_and_again_are_a_pendulum(L):
    L.worker(0)
    session = L.uid("s")
    blocks = L.commit(0, L.rng.randrange(2, 12), session=session)
    steady = L.commit(0, 4)
    L.move(0, "spill", "device", "host", steady, keep=True)       # one-way: not a swing
    _swing(L, 0, blocks, times=3, gap_s=2)
    [f] = detect_pendulum(L.events, at_ns=L.now)
    assert f.detector == "pendulum" and f.detail["num_blocks"] == len(blocks)
    assert f.detail["blocks"] == sorted(blocks)[:32]
    assert f.until_ns is None   # still swinging at "now"
    assert len(f.seqs) >= 6
    # judged a long time later, the episode is over and carries its end
    [later] = detect_pendulum(L.events, at_ns=L.now + 3600 * SECOND)
    assert later.until_ns is not None and later.until_ns <= L.now


def test_round_trips_spread_out_in_time_are_not_a_pendulum(L):
    L.worker(0)
    blocks = L.commit(0, 5)
    _swing(L, 0, blocks, times=3, gap_s=40)      # 6 swings over 4 minutes, window is 60 s
    assert detect_pendulum(L.events, at_ns=L.now) == []
    # the same swings with a wider window are one
    assert len(detect_pendulum(L.events, at_ns=L.now, params=DiagnoseParams(pendulum_window_ns=600 * SECOND))) == 1


def test_two_round_trips_are_not_yet_a_pendulum(L):
    L.worker(0)
    _swing(L, 0, L.commit(0, 3), times=2, gap_s=1)
    assert detect_pendulum(L.events, at_ns=L.now) == []
    assert MS  # (units used by the builders)


def _idle_park_then_demand_restore(L, w, blocks, session, think_s):
    mid, _ = L.request_move(w, "park", "device", "host", blocks, session=session, reason="idle 2 s",
                            causation="policy:park")
    L.ack(mid, w, len(blocks) * L.block_bytes[w])
    L.wait(think_s)
    mid, _ = L.request_move(w, "restore", "host", "device", blocks, session=session, reason="serving:restore",
                            causation="serving:restore")
    L.ack(mid, w, len(blocks) * L.block_bytes[w])
    L.wait(L.rng.uniform(0.5, 2.0))


def test_idle_parks_restored_for_their_own_next_turn_are_not_a_pendulum(L):
    from residency.control.diagnose import diagnose
    L.worker(0)
    users = {L.uid("s"): L.commit(0, L.rng.randrange(2, 9)) for _ in range(2)}
    for _ in range(20):                       # two users chatting with 4-6 s of think time
        for s, blocks in users.items():
            _idle_park_then_demand_restore(L, 0, blocks, s, L.rng.uniform(2.0, 4.0))
    d = diagnose(L.events, at_ns=L.now)
    assert [f for f in d.findings if f.severity != "info"] == []


def test_a_pendulum_names_who_asked_and_counts_every_swinging_move(L):
    from residency.control.diagnose import detect_pendulum
    L.worker(0)
    blocks = L.commit(0, 4)
    mids = []
    for _ in range(3):
        mid, _ = L.request_move(0, "spill", "device", "host", blocks, causation="policy:pressure")
        L.ack(mid, 0, len(blocks) * L.block_bytes[0])
        mids.append(mid)
        mid, _ = L.request_move(0, "restore", "host", "device", blocks, causation="serving:restore")
        L.ack(mid, 0, len(blocks) * L.block_bytes[0])
        mids.append(mid)
    [f] = detect_pendulum(L.events, at_ns=L.now)
    assert f.detail["num_moves"] == 6 and f.detail["bytes_moved"] == 6 * len(blocks) * L.block_bytes[0]
    assert f.detail["asked_by"] == ["policy", "serving"] and "policy (3)" in f.title
