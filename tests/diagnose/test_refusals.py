from residency.events import catalog as ev
from residency.control.diagnose import detect_refusal_storms, detect_retried_smaller
from tests.diagnose.ledgers import SECOND


def refuse(L, asked, *, ask="client:restore", worker=0, tier="device", session=None, dt_ms=100.0, causation=None):
    return L.add(ev.MoveRefused(ask=ask, worker=worker, tier=tier, asked_bytes=asked,
                                available_bytes=asked // 3, floor_bytes=asked // 10, reason="asked exceeds available",
                                session=session), dt_ms=dt_ms, causation=causation)


def test_the_same_ask_refused_again_and_again_is_a_storm(L):
    L.worker(0)
    asked = L.rng.randrange(10, 500) << 20
    storm = [refuse(L, asked, dt_ms=L.rng.randrange(5, 300)) for _ in range(L.rng.randrange(4, 9))]
    [f] = detect_refusal_storms(L.events, at_ns=L.now)
    assert f.detail["num_refusals"] == len(storm) and f.detail["asked_bytes"] == asked
    assert {r.seq for r in storm} <= set(f.seqs)
    assert f.onset_ns == storm[0].envelope.ts_ns and f.until_ns is None
    [later] = detect_refusal_storms(L.events, at_ns=L.now + 3600 * SECOND)
    assert later.until_ns == storm[-1].envelope.ts_ns


def test_different_asks_or_slow_repeats_are_not_a_storm(L):
    L.worker(0)
    for i in range(10):
        refuse(L, (i + 1) << 22, dt_ms=50)                      # ten different sizes
    for _ in range(5):
        refuse(L, 7 << 20, ask="client:park", dt_ms=5000)        # the same ask every 5 s
    refuse(L, 3 << 20, ask="client:spill")
    refuse(L, 3 << 20, ask="client:spill")                       # twice is not a storm
    assert detect_refusal_storms(L.events, at_ns=L.now) == []


def test_a_refused_ask_granted_smaller_for_the_same_session_is_retried_smaller(L):
    L.worker(0)
    session = L.uid("s")
    blocks = L.commit(0, 40, tier="host", session=session)
    asked = len(blocks) * L.block_bytes[0]
    refusal = refuse(L, asked, session=session)
    mid, smaller = L.request_move(0, "restore", "host", "device", blocks[:10], session=session)
    [f] = detect_retried_smaller(L.events, at_ns=L.now)
    assert {refusal.seq, smaller.seq} <= set(f.seqs)
    assert f.detail["smallest_retry_bytes"] == 10 * L.block_bytes[0] and f.detail["num_granted"] == 1


def test_a_smaller_refusal_caused_by_the_first_is_retried_smaller(L):
    L.worker(0)
    first = refuse(L, 64 << 20)
    second = refuse(L, 32 << 20, causation=str(first.seq))
    [f] = detect_retried_smaller(L.events, at_ns=L.now)
    assert {first.seq, second.seq} <= set(f.seqs) and f.detail["num_granted"] == 0


def test_asking_the_same_again_or_unrelated_smaller_asks_are_not_retried_smaller(L):
    L.worker(0)
    session = L.uid("s")
    blocks = L.commit(0, 8, tier="host", session=session)
    refuse(L, 8 * L.block_bytes[0], session=session)
    L.wait(1)
    L.move(0, "restore", "host", "device", blocks, session=session)   # the whole ask, once room was made
    refuse(L, 90 << 20)
    refuse(L, 10 << 20)                                                # no session, no causation: a new ask
    other = L.uid("s")
    L.request_move(0, "restore", "host", "device", L.commit(0, 1, tier="host", session=other), session=other)
    assert detect_retried_smaller(L.events, at_ns=L.now) == []
