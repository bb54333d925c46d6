from residency.events import catalog as ev
from residency.control.diagnose import detect_crashes, detect_stalls, diagnose
from tests.diagnose.ledgers import SECOND


def _start(L):
    return L.add(ev.ServerStarted(version="test", config_digest=f"{L.rng.getrandbits(64):016x}"))


def _crash_and_restart(L, *, close=True):
    """Two workers serve; control dies with requests running; a new one starts, adopts worker 0,
    declares worker 1 lost, and (by the contract) closes every orphan with reason control_lost."""
    _start(L)
    L.worker(0)
    L.worker(1)
    running = [L.admit()[0] for _ in range(L.rng.randrange(2, 6))]
    last = L.step(0, 1)
    L.wait(L.rng.randrange(20, 90))         # the control process is dead: nothing written
    start = _start(L)
    closed = []
    if close:
        for rid in running:
            closed.append(L.add(ev.RequestFinished(request_id=rid, reason="control_lost",
                                                   completion_tokens=L.rng.randrange(0, 50))))
    L.add(ev.WorkerLost(worker=1, reason="did not come back within 10 s of the control restart"))
    L.step(0, 2, num_seqs=0)
    return running, last, start, closed


def test_a_start_with_no_stop_before_it_is_named_a_crash_with_adoption_and_orphans_closed(L):
    running, last, start, closed = _crash_and_restart(L)
    L.chatter(300)
    [f] = detect_crashes(L.events, at_ns=L.now)
    assert f.onset_ns == last.envelope.ts_ns and f.until_ns == start.envelope.ts_ns
    assert f.detail["restart_seq"] == start.seq and start.seq in f.seqs
    assert f.detail["adopted"] == [0] and f.detail["lost"] == [1]
    assert f.detail["num_orphaned"] == len(running) == f.detail["num_closed_by_recovery"]
    assert f.severity == "warning" and f.detail["never_closed"] == []


def test_orphans_of_a_crash_are_not_a_stall_on_the_idle_server_after_it(L):
    _crash_and_restart(L)
    L.chatter(600)
    d = diagnose(L.events, at_ns=L.now)
    assert sorted(f.detector for f in d.findings) == ["crash", "worker"]      # worker 1 was lost, nothing stalled


def test_orphans_recovery_never_closed_are_named_and_still_not_a_stall(L):
    running, _, _, _ = _crash_and_restart(L, close=False)
    L.chatter(120)
    [f] = detect_crashes(L.events, at_ns=L.now)
    assert f.severity == "critical" and sorted(f.detail["never_closed"]) == sorted(running)
    assert detect_stalls(L.events, at_ns=L.now) == []


def test_a_clean_restart_is_not_a_crash(L):
    _start(L)
    L.worker(0)
    rid, _ = L.admit()
    L.step(0, 1)
    L.finish(rid)
    L.add(ev.ServerStopped(reason="signal SIGINT"))
    L.wait(30)
    _start(L)
    L.worker(0)
    assert detect_crashes(L.events, at_ns=L.now) == []


def test_a_stall_before_a_crash_ends_at_the_last_event_the_dead_process_wrote(L):
    _start(L)
    L.worker(0)
    L.step(0, 1)
    L.admit()
    L.chatter(15)
    last = L.events[-1]
    L.wait(60)
    start = _start(L)
    [f] = detect_stalls(L.events, at_ns=L.now + 600 * SECOND)
    assert f.until_ns == last.envelope.ts_ns and start.seq in f.seqs
