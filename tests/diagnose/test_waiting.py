from residency.events import catalog as ev
from residency.control.diagnose import DiagnoseParams, detect_queued, detect_tier_full, diagnose
from tests.diagnose.ledgers import SECOND


def _queue(L, w, parks=(), needed=12, free=3):
    rid = L.uid("req")
    rec = L.add(ev.RequestQueued(request_id=rid, session=None, worker=w, prompt_tokens=L.rng.randrange(10, 4000),
                                 waiting_for=f"needs {needed} device pages, {free} free", needed_blocks=needed,
                                 free_blocks=free, parks=list(parks)), correlation=rid)
    return rid, rec


def _park_refused(L, w, session, available):
    return L.add(ev.MoveRefused(ask="serving:park", worker=w, tier="host", asked_bytes=8 * L.block_bytes[w],
                                available_bytes=available, floor_bytes=L.block_bytes[w],
                                reason="host has no room", session=session))


def test_one_request_queued_with_nothing_running_is_named_with_its_onset_and_the_refused_park(L):
    L.worker(0)
    idle = L.uid("s")
    rid, first = _queue(L, 0, parks=[idle])
    refusals = []
    for _ in range(4):
        L.chatter(2.5)
        refusals.append(_park_refused(L, 0, idle, L.rng.randrange(0, 1 << 20)))
    [f] = detect_queued(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.onset_ns == first.envelope.ts_ns and f.detail["onset_seq"] == first.seq
    assert f"since seq {first.seq}" in f.title
    assert idle in f.detail["cause"] and "refused 4 time(s)" in f.detail["cause"]
    assert f"available" in f.detail["cause"] and refusals[-1].seq in f.seqs
    assert f.detail["num_waiting"] == 1 and f.detail["num_running"] == 0


def test_a_short_wait_that_ended_in_admission_is_not_a_finding(L):
    L.worker(0)
    rid, _ = _queue(L, 0)
    L.chatter(1)
    L.add(ev.RequestAdmitted(request_id=rid, session=None, prompt_tokens=100, worker=0))
    assert detect_queued(L.events, at_ns=L.now + 600 * SECOND) == []


def test_a_wait_that_timed_out_is_reported_as_over_with_the_refusals_counted(L):
    L.worker(0)
    rids = [_queue(L, 0)[0] for _ in range(3)]
    L.chatter(7)
    for rid in rids:
        last = L.add(ev.RequestRefused(request_id=rid, reason="insufficient_kv_capacity: waited"))
    [f] = detect_queued(L.events, at_ns=L.now)
    assert f.severity == "warning" and f.until_ns == last.envelope.ts_ns
    assert f.detail["num_refused"] == 3 and f.detail["num_requests"] == 3


def test_queued_requests_end_at_the_server_stop(L):
    L.worker(0)
    _queue(L, 0)
    L.chatter(8)
    stop = L.add(ev.ServerStopped(reason="signal SIGTERM"))
    [f] = detect_queued(L.events, at_ns=L.now + 3600 * SECOND)
    assert f.until_ns == stop.envelope.ts_ns


def _tier_refusals(L, w, every_s, seconds, ask="serving:park"):
    out = []
    sessions = [L.uid("s") for _ in range(3)]
    t = 0.0
    while t < seconds:
        for s in sessions:
            out.append(L.add(ev.MoveRefused(ask=ask, worker=w, tier="host", asked_bytes=L.rng.randrange(1, 64) << 20,
                                            available_bytes=0, floor_bytes=L.block_bytes[w], reason="host is full",
                                            session=s)))
        L.wait(every_s)
        t += every_s
    return out, sessions


def test_a_host_tier_that_refuses_callers_who_back_off_is_a_finding_with_its_arithmetic(L):
    L.worker(0, host_blocks=32)
    L.commit(0, 30, tier="host")
    refusals, sessions = _tier_refusals(L, 0, every_s=2.0, seconds=20)
    # the refusal storm detector sees no storm: each ask comes back only every 2 s
    d = diagnose(L.events, at_ns=L.now)
    assert not [f for f in d.findings if f.detector == "refusal_storm"]
    [f] = [f for f in d.findings if f.detector == "tier_full"]
    assert f.onset_ns == refusals[0].envelope.ts_ns and f.detail["onset_seq"] == refusals[0].seq
    assert f.detail["used_bytes"] == 30 * L.block_bytes[0] and f.detail["limit_bytes"] == 32 * L.block_bytes[0]
    assert f.detail["num_refusals"] == len(refusals) and set(f.detail["sessions"]) == set(sessions)
    assert f.detail["callers_back_off"] and "already back off" in f.suggestion and "back off;" not in f.suggestion


def test_a_tier_full_ends_when_an_ask_into_it_is_funded(L):
    L.worker(0)
    refusals, _ = _tier_refusals(L, 0, every_s=3.0, seconds=15, ask="policy:demote")
    blocks = L.commit(0, 2)
    _, funded = L.request_move(0, "park", "device", "host", blocks)
    [f] = detect_tier_full(L.events, at_ns=L.now)
    assert f.until_ns == funded.envelope.ts_ns


def test_a_few_refusals_within_the_threshold_are_not_a_full_tier(L):
    L.worker(0)
    _tier_refusals(L, 0, every_s=1.0, seconds=4)
    assert detect_tier_full(L.events, at_ns=L.now, params=DiagnoseParams()) == []
