from residency.events import catalog as ev
from residency.control.diagnose import detect_torn_rebinds
from tests.diagnose.ledgers import SECOND

READERS = ["scheduler", "worker_views", "host_staging"]


def rebind(L, worker=0, pool="device", gen=0, stamp=READERS, end="commit"):
    rid = L.uid("rb")
    req = L.add(ev.RebindRequested(rebind_id=rid, worker=worker, pool=pool, from_gen=gen, to_gen=gen + 1,
                                   readers=list(READERS)))
    for r in stamp:
        L.add(ev.ReaderStamped(rebind_id=rid, reader=r, gen=gen + 1))
    last = None
    if end == "commit":
        last = L.add(ev.RebindCommitted(rebind_id=rid))
    elif end == "torn":
        last = L.add(ev.RebindTorn(rebind_id=rid, readers_behind=[r for r in READERS if r not in stamp]))
    return rid, req, last


def test_a_rebind_recorded_torn_leaves_readers_on_different_generations(L):
    L.worker(0)
    behind = L.rng.choice(READERS)
    rid, req, torn = rebind(L, stamp=[r for r in READERS if r != behind], end="torn")
    [f] = detect_torn_rebinds(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.detail["readers_behind"] == [behind] and rid in f.title
    assert {req.seq, torn.seq} <= set(f.seqs)


def test_a_rebind_committed_with_a_reader_behind_is_torn(L):
    L.worker(0)
    rid, req, commit = rebind(L, stamp=READERS[:1], end="commit")
    [f] = detect_torn_rebinds(L.events, at_ns=L.now)
    assert "committed while readers were behind" in f.title and commit.seq in f.seqs
    assert f.detail["readers_behind"] == sorted(READERS[1:])


def test_a_rebind_pending_past_its_timeout_with_readers_split_is_torn(L):
    L.worker(0)
    rid, req, _ = rebind(L, stamp=READERS[:2], end=None)
    assert detect_torn_rebinds(L.events, at_ns=L.now + 1 * SECOND) == []      # still within the timeout
    [f] = detect_torn_rebinds(L.events, at_ns=L.now + 30 * SECOND)
    assert f.severity == "critical" and f.detail["readers_behind"] == [READERS[2]]


def test_a_tear_healed_by_a_later_complete_rebind_is_an_ended_episode(L):
    L.worker(0)
    rebind(L, gen=0, stamp=READERS[:2], end="torn")
    L.chatter(2)
    _, _, healed = rebind(L, gen=1)
    [f] = detect_torn_rebinds(L.events, at_ns=L.now)
    assert f.severity == "info" and f.until_ns == healed.envelope.ts_ns and healed.seq in f.seqs


def test_complete_rebinds_are_not_torn(L):
    L.worker(0)
    L.worker(1)
    for gen in range(L.rng.randrange(2, 6)):
        rebind(L, worker=gen % 2, gen=gen)
    assert detect_torn_rebinds(L.events, at_ns=L.now + 3600 * SECOND) == []


def test_a_rebind_its_worker_refused_changed_nothing_and_is_no_finding(L):
    L.worker(0)
    rid, req, _ = rebind(L, stamp=[], end=None)
    L.add(ev.RebindRefused(rebind_id=rid, worker=0, error="asked 2 TiB > 80 GiB on the card"))
    assert detect_torn_rebinds(L.events, at_ns=L.now + 60 * SECOND) == []


def test_a_torn_pool_of_a_worker_replaced_by_a_new_incarnation_is_gone_with_it(L):
    L.worker(0)
    rebind(L, stamp=READERS[:1], end="torn")
    assert [f.severity for f in detect_torn_rebinds(L.events, at_ns=L.now)] == ["critical"]
    L.worker(0)          # the next incarnation joins with a new pool
    assert detect_torn_rebinds(L.events, at_ns=L.now) == []
