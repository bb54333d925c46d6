from residency.control.diagnose import detect_wedged_workers, diagnose
from residency.events import catalog as ev
from tests.diagnose.ledgers import MS, SECOND


def _wedge(L, w: int, n: int):
    ids = [L.uid("chatcmpl") for _ in range(n)]
    stalled = L.rng.randrange(2000, 9000)
    rec = L.add(ev.WorkerWedged(worker=w, running=n, last_step=L.rng.randrange(1, 10**5), stalled_ms=stalled,
                                deadline_ms=stalled - L.rng.randrange(1, 500), request_ids=ids))
    for rid in ids:
        L.add(ev.RequestFinished(request_id=rid, reason="error", completion_tokens=L.rng.randrange(0, 50)))
    return rec, ids


def test_a_wedged_worker_is_critical_from_its_last_step_with_the_requests_it_failed(L):
    L.worker(0)
    L.worker(1)
    L.step(0, 1)
    wedged, ids = _wedge(L, 0, L.rng.randrange(1, 5))
    refused = L.add(ev.RequestRefused(request_id=L.uid("chatcmpl"),
                                      reason="worker_wedged: worker 0 makes no progress; retry shortly"))
    L.add(ev.RequestRefused(request_id=L.uid("chatcmpl"), reason="worker_wedged: worker 1 makes no progress"))
    L.step(1, 9)                                   # the other worker steps: nothing to say of 0
    L.chatter(3)
    [f] = detect_wedged_workers(L.events, at_ns=L.now)
    assert f.detector == "wedged_worker" and f.severity == "critical" and f.until_ns is None
    assert f.subject == "worker 0" and f.detail["onset_seq"] == wedged.seq
    assert f.onset_ns == wedged.envelope.ts_ns - wedged.event.stalled_ms * MS
    assert {wedged.seq, refused.seq} <= set(f.seqs)
    assert f.detail["requests_answered"] == ids and f.detail["requests_refused"] == 1
    assert f"{len(ids)} answered 503" in f.title


def test_a_wedge_that_ended_is_a_warning_with_its_end(L):
    L.worker(0)
    wedged, _ = _wedge(L, 0, 2)
    L.wait(L.rng.randrange(1, 30))
    back = L.add(ev.WorkerResumed(worker=0, step=wedged.event.last_step + 1, wedged_ms=1234))
    [f] = detect_wedged_workers(L.events, at_ns=L.now + 60 * SECOND)
    assert f.severity == "warning" and f.until_ns == back.envelope.ts_ns and back.seq in f.seqs
    assert f.detail["ended"] == "resumed" and "resumed after" in f.title


def test_a_wedged_worker_lost_ends_the_wedge_and_the_full_pass_names_both(L):
    L.worker(0)
    _wedge(L, 0, 1)
    lost = L.add(ev.WorkerLost(worker=0, reason="worker process exited with code -9"))
    found = diagnose(L.events, at_ns=L.now).findings
    wedge = next(f for f in found if f.detector == "wedged_worker")
    assert wedge.until_ns == lost.envelope.ts_ns and wedge.detail["ended"] == "lost"
    assert any(f.detector == "worker" for f in found)
