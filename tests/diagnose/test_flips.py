from residency.events import catalog as ev
from residency.control.diagnose import detect_flip_pendulum, detect_stuck_flips, diagnose
from tests.diagnose.ledgers import SECOND

GiB = 1 << 30


def loaded(L, worker=0, model="a"):
    L.worker(worker)
    L.add(ev.WeightsLoaded(worker=worker, arena="weights", model=model, bytes=L.rng.randrange(1, 16) * GiB))


def flip(L, worker, frm, to, *, end="complete", action="flip", deadline_ns=0):
    fid = L.uid("fl")
    nbytes = L.rng.randrange(1, 16) * GiB
    req = L.add(ev.FlipRequested(flip_id=fid, worker=worker, arena="weights", from_model=frm, to_model=to,
                                 bytes_out=nbytes, bytes_in=nbytes + L.rng.randrange(GiB), action=action,
                                 deadline_ns=deadline_ns))
    last = None
    if end == "complete":
        last = L.add(ev.FlipCompleted(flip_id=fid, bytes_out=nbytes, bytes_in=nbytes, started_ns=L.now,
                                      finished_ns=L.now + SECOND, overlapped_steps=3, checksum_ok=True, worker=worker),
                     dt_ms=L.rng.randrange(200, 2000))
    elif end == "stranded":
        last = L.add(ev.FlipFailed(flip_id=fid, error="no answer by the deadline", stranded=True,
                                   stranded_bytes=nbytes), dt_ms=5000)
    return fid, req, last


def serve(L, worker, n):
    for _ in range(n):
        L.add(ev.RequestAdmitted(request_id=L.uid("req"), session=None, prompt_tokens=L.rng.randrange(1, 500),
                                 worker=worker))


def test_a_flip_pendulum_names_every_swing_and_its_seqs(L):
    loaded(L)
    swings = L.rng.randrange(3, 7)
    seqs, at = [], "a"
    for _ in range(swings):
        to = "b" if at == "a" else "a"
        fid, req, done = flip(L, 0, at, to)
        seqs += [req.seq, done.seq]
        serve(L, 0, L.rng.randrange(0, 3))          # little served between swings
        at = to
    [f] = detect_flip_pendulum(L.events, at_ns=L.now)
    assert f.detail["num_flips"] == swings and f.detail["models"] == ["a", "b"]
    assert f"swung {swings} times" in f.title and set(f.seqs) <= set(seqs) and seqs[0] in f.seqs


def test_flips_that_serve_a_lot_between_them_or_go_elsewhere_are_no_pendulum(L):
    loaded(L)
    at = "a"
    for _ in range(L.rng.randrange(3, 6)):          # A->B->A..., each swing with plenty served
        to = "b" if at == "a" else "a"
        flip(L, 0, at, to)
        serve(L, 0, L.rng.randrange(10, 20))
        at = to
    flip(L, 0, at, "c")                              # and on to a third model
    serve(L, 0, 1)
    flip(L, 0, "c", "d")
    assert detect_flip_pendulum(L.events, at_ns=L.now) == []
    assert [f for f in diagnose(L.events).findings if f.detector.startswith("flip_")] == []


def test_swings_spread_past_the_window_are_no_pendulum(L):
    loaded(L)
    at = "a"
    for _ in range(4):
        to = "b" if at == "a" else "a"
        flip(L, 0, at, to)
        L.wait(200)                                  # longer than the window apart
        at = to
    assert detect_flip_pendulum(L.events, at_ns=L.now) == []


def test_a_flip_never_answered_past_its_deadline_is_stuck(L):
    loaded(L)
    deadline = L.now + 30 * SECOND
    fid, req, _ = flip(L, 0, "a", "b", end=None, deadline_ns=deadline)
    assert detect_stuck_flips(L.events, at_ns=deadline) == []           # not yet due
    [f] = detect_stuck_flips(L.events, at_ns=deadline + 60 * SECOND)
    assert f.severity == "critical" and fid in f.title and req.seq in f.seqs


def test_a_stranded_flip_is_stuck_until_a_complete_flip_repairs_it(L):
    loaded(L)
    fid, req, failed = flip(L, 0, "a", "", end="stranded", action="sleep")
    [f] = detect_stuck_flips(L.events, at_ns=L.now)
    assert "stranded" in f.title and {req.seq, failed.seq} <= set(f.seqs)
    flip(L, 0, "", "a", action="wake")                 # a complete wake repairs the arena
    assert detect_stuck_flips(L.events, at_ns=L.now + 3600 * SECOND) == []


def test_healthy_flips_and_a_new_incarnation_leave_nothing_stuck(L):
    loaded(L)
    flip(L, 0, "a", "b")
    flip(L, 0, "b", "", action="sleep")
    flip(L, 0, "", "b", action="wake")
    flip(L, 0, "b", "a", end=None)                  # in flight when the worker is replaced
    loaded(L)
    assert detect_stuck_flips(L.events, at_ns=L.now + 3600 * SECOND) == []
