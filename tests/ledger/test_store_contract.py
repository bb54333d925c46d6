"""The LedgerStore contract, written once, run on SQLite file, SQLite memory and PostgreSQL."""
from __future__ import annotations

import threading
import time

import pytest

from residency.events import Envelope
from residency.events.catalog import StateCheckpoint
from residency.ledger import LedgerConflict, LedgerStore
from residency.ledger.chain import GENESIS, row_hash
from tests.ledger.factories import envelope, random_event, random_items


def test_an_empty_ledger_has_no_events_and_verifies(ledger_store):
    assert ledger_store.last_seq() == 0
    assert list(ledger_store.read()) == []
    report = ledger_store.verify()
    assert report.ok and report.num_events == 0 and report.last_hash == GENESIS


def test_appends_get_gapless_seqs_and_read_back_exactly(ledger_store, rng):
    items = random_items(rng, rng.randint(30, 80))
    first = rng.randint(1, len(items) - 1)
    assert ledger_store.append(items[:first]) == list(range(1, first + 1))
    assert ledger_store.append(items[first:]) == list(range(first + 1, len(items) + 1))
    assert ledger_store.last_seq() == len(items)
    got = list(ledger_store.read())
    assert [r.seq for r in got] == list(range(1, len(items) + 1))
    prev = GENESIS
    for rec, raw, (env, ev) in zip(got, ledger_store.read_raw(), items):
        assert rec.event == ev
        assert rec.envelope == Envelope(**{**_fields(env), "seq": rec.seq})
        assert rec.row_hash == raw.row_hash == row_hash(prev, raw)
        assert raw.type == type(ev).__name__ and raw.schema_version == type(ev).SCHEMA_VERSION
        prev = rec.row_hash


def test_read_honours_from_and_to(ledger_store, rng):
    n = rng.randint(20, 50)
    ledger_store.append(random_items(rng, n))
    lo = rng.randint(1, n)
    hi = rng.randint(lo, n)
    assert [r.seq for r in ledger_store.read(lo, hi)] == list(range(lo, hi + 1))
    assert [r.seq for r in ledger_store.read_raw(lo)] == list(range(lo, n + 1))
    assert list(ledger_store.read(n + 1)) == []


def test_reads_stream_across_batches(ledger_store, rng, monkeypatch):
    import residency.ledger.store as store_mod

    monkeypatch.setattr(store_mod, "READ_BATCH", 7)
    n = rng.randint(40, 60)
    ledger_store.append(random_items(rng, n))
    batches = list(ledger_store.raw_batches())
    assert [len(b) for b in batches] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
    assert [r.seq for r in ledger_store.read()] == list(range(1, n + 1))
    assert [r.seq for r in ledger_store.read(8, n - 8)] == list(range(8, n - 7))


def test_a_retried_triple_returns_its_seq_and_writes_nothing(ledger_store, rng):
    items = random_items(rng, 20)
    seqs = ledger_store.append(items)
    picks = rng.sample(range(20), 5)
    retried = [items[i] for i in picks]
    assert ledger_store.append(retried) == [seqs[i] for i in picks]
    assert ledger_store.last_seq() == 20
    # a batch mixing retries and new events: retries keep their seqs, new ones continue the sequence
    env, ev = items[0]
    new = random_items(rng, 3, producer=env.producer, epoch=env.epoch, start=21)
    assert ledger_store.append([items[3], *new, items[7]]) == [4, 21, 22, 23, 8]
    # the same triple twice inside one batch is one event
    again = random_items(rng, 1, producer=env.producer, epoch=env.epoch, start=24)[0]
    assert ledger_store.append([again, again]) == [24, 24]
    assert ledger_store.last_seq() == 24
    assert ledger_store.verify().ok


def test_a_retry_with_another_payload_is_a_conflict_and_the_batch_writes_nothing(ledger_store, rng):
    items = random_items(rng, 10)
    ledger_store.append(items)
    env, ev = items[rng.randrange(10)]
    other = random_event(rng, type(ev).__name__)
    while other == ev:
        other = random_event(rng, type(ev).__name__)
    fresh = random_items(rng, 5)
    with pytest.raises(LedgerConflict, match=f"producer_seq {env.producer_seq} is already seq"):
        ledger_store.append([*fresh, (env, other)])
    assert ledger_store.last_seq() == 10          # the fresh events of that batch were not written
    # the same triple inside one batch with two payloads conflicts too
    dup = random_items(rng, 1)[0]
    with pytest.raises(LedgerConflict):
        ledger_store.append([dup, (dup[0], random_event(rng, "StateCheckpoint"))] if type(dup[1]).__name__ != "StateCheckpoint"
                            else [dup, (dup[0], random_event(rng, "ServerStopped"))])
    assert ledger_store.last_seq() == 10
    assert ledger_store.verify().ok


def test_concurrent_appenders_get_gapless_seqs_in_commit_order(ledger_store, rng):
    num_threads, per_thread = 4, 25
    plans = [random_items(rng, per_thread, producer=f"worker:{i}", epoch=1) for i in range(num_threads)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads)

    def run(i: int) -> None:
        try:
            start.wait()
            out = []
            for k in range(0, per_thread, 5):       # small batches interleave between threads
                out += ledger_store.append(plans[i][k:k + 5])
            results[i] = out
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    total = num_threads * per_thread
    assert sorted(s for seqs in results.values() for s in seqs) == list(range(1, total + 1))
    for i, seqs in results.items():                 # each producer's order is kept
        assert seqs == sorted(seqs)
        assert [r.envelope.producer_seq for r in ledger_store.read() if r.envelope.producer == f"worker:{i}"] \
            == list(range(1, per_thread + 1))
    report = ledger_store.verify()
    assert report.ok and report.num_events == total


def test_seq_at_time_is_the_last_seq_at_or_before_an_instant(ledger_store, rng):
    n = rng.randint(20, 40)
    times = sorted(rng.sample(range(10**18, 10**18 + 10**12), n))
    ledger_store.append([(Envelope(producer="control", epoch=1, producer_seq=i + 1, ts_ns=t), random_event(rng))
                         for i, t in enumerate(times)])
    assert ledger_store.seq_at_time(times[0] - 1) == 0
    k = rng.randrange(n)
    assert ledger_store.seq_at_time(times[k]) == k + 1
    if k + 1 < n and times[k + 1] > times[k] + 1:
        assert ledger_store.seq_at_time(times[k] + 1) == k + 1
    assert ledger_store.seq_at_time(times[-1] + 10**9) == n
    # producers' clocks disagree: the answer is the LAST seq stamped at or before the instant
    late = Envelope(producer="worker:9", epoch=1, producer_seq=1, ts_ns=times[0])
    ledger_store.append([(late, random_event(rng))])
    assert ledger_store.seq_at_time(times[0]) == n + 1


def _checkpoint(store, rng, through: int, digest: str) -> int:
    """Append the StateCheckpoint that vouches for a snapshot; returns its seq."""
    env = Envelope(producer="test-checkpoints", epoch=rng.randrange(1 << 40), producer_seq=1, ts_ns=time.time_ns())
    return store.append([(env, StateCheckpoint(through_seq=through, state_hash=digest))])[0]


def test_snapshots_load_the_newest_at_or_before_a_seq(ledger_store, rng):
    ledger_store.append(random_items(rng, 30))
    assert ledger_store.load_snapshot(30) is None
    saved = {}
    for through in sorted(rng.sample(range(1, 31), 4)):
        state = rng.randbytes(rng.randint(1, 5000))
        digest = rng.randbytes(16).hex()
        saved[through] = (state, digest, _checkpoint(ledger_store, rng, through, digest))
        ledger_store.save_snapshot(through, state, digest, saved[through][2])
    for at in range(0, 31):
        best = max((t for t in saved if t <= at), default=None)
        snap = ledger_store.load_snapshot(at)
        if best is None:
            assert snap is None
        else:
            assert (snap.through_seq, snap.state_bytes, snap.state_hash, snap.checkpoint_seq) == (best, *saved[best])
            assert snap.refused is None
    # saving again at the same seq replaces it
    through = rng.choice(list(saved))
    cp = _checkpoint(ledger_store, rng, through, "h2")
    ledger_store.save_snapshot(through, b"replaced" + rng.randbytes(8), "h2", cp)
    assert ledger_store.load_snapshot(through).state_hash == "h2"
    last = ledger_store.last_seq()
    with pytest.raises(LedgerConflict, match="past the end of the ledger"):
        ledger_store.save_snapshot(last + 1, b"x", "h", cp)


def test_a_snapshot_needs_a_checkpoint_in_the_chain_that_names_it(ledger_store, rng):
    ledger_store.append(random_items(rng, 10))
    digest = rng.randbytes(16).hex()
    cp = _checkpoint(ledger_store, rng, 7, digest)
    with pytest.raises(LedgerConflict, match=f"seq {cp}.*records state hash"):
        ledger_store.save_snapshot(7, rng.randbytes(50), rng.randbytes(16).hex(), cp)     # another hash
    with pytest.raises(LedgerConflict, match="records state hash"):
        ledger_store.save_snapshot(6, rng.randbytes(50), digest, cp)                     # another seq
    with pytest.raises(LedgerConflict, match="seq 3 is a "):
        ledger_store.save_snapshot(2, rng.randbytes(50), digest, 3)                      # not a checkpoint
    with pytest.raises(LedgerConflict, match="not after its own seq"):
        ledger_store.save_snapshot(7, rng.randbytes(50), digest, 5)
    assert ledger_store.load_snapshot(10) is None


def test_a_ledger_survives_close_and_reopen(ledger_url, rng):
    if ledger_url == "sqlite:///:memory:":
        pytest.skip("an in-memory database ends with its store")
    items = random_items(rng, 15)
    with LedgerStore.open(ledger_url, create=True) as store:
        store.append(items)
        last_hash = store.verify().last_hash
    with LedgerStore.open(ledger_url) as store:
        assert store.last_seq() == 15
        assert store.verify().last_hash == last_hash
        assert [r.event for r in store.read()] == [ev for _, ev in items]


def test_durability_levels_are_named_and_checked(ledger_store, rng):
    items = random_items(rng, 4)
    assert ledger_store.append(items[:2], durability="normal") == [1, 2]
    assert ledger_store.append(items[2:], durability="full") == [3, 4]
    with pytest.raises(ValueError, match="durability"):
        ledger_store.append(random_items(rng, 1), durability="fast")


def test_append_refuses_things_that_are_not_events(ledger_store, rng):
    env = envelope(rng, "control", 1, 1)
    with pytest.raises(TypeError, match="not an event"):
        ledger_store.append([(env, {"type": "MoveAcked"})])
    assert ledger_store.append([]) == []
    assert ledger_store.last_seq() == 0


def _fields(env: Envelope) -> dict:
    return {f: getattr(env, f) for f in env.__struct_fields__}


def test_two_stores_on_one_database_still_get_gapless_seqs(ledger_url, rng):
    """Two stores = two processes' worth of connections: only the database lock orders them."""
    if ledger_url == "sqlite:///:memory:":
        pytest.skip("an in-memory database cannot be shared by two stores")
    LedgerStore.open(ledger_url, create=True).close()
    stores = [LedgerStore.open(ledger_url) for _ in range(2)]
    plans = [random_items(rng, 40, producer=f"control:{i}", epoch=1) for i in range(2)]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            start.wait()
            for k in range(0, 40, 4):
                stores[i].append(plans[i][k:k + 4])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert [r.seq for r in stores[0].read()] == list(range(1, 81))
        assert stores[1].verify().ok
    finally:
        for s in stores:
            s.close()


def test_the_chain_is_the_documented_formula(ledger_store, rng):
    """Recomputed here from the spec alone: SHA-256(prev || msgpack[seq .. payload]), genesis = 32 zero bytes."""
    import hashlib

    import msgspec

    items = random_items(rng, rng.randint(3, 12))
    ledger_store.append(items)
    prev = bytes(32)
    for rec, (env, ev) in zip(ledger_store.read(), items):
        canonical = msgspec.msgpack.encode([rec.seq, env.ts_ns, env.producer, env.epoch, env.producer_seq,
                                            type(ev).__name__, type(ev).SCHEMA_VERSION, env.correlation_id,
                                            env.causation, msgspec.msgpack.encode(ev)])
        prev = hashlib.sha256(prev + canonical).digest()
        assert rec.row_hash == prev


def _prefetch_threads() -> int:
    return sum(t.name == "ledger-prefetch" and t.is_alive() for t in threading.enumerate())


def test_an_abandoned_read_stops_its_prefetch_thread(ledger_store, rng):
    import time

    ledger_store.append(random_items(rng, rng.randint(30, 50)))
    before = _prefetch_threads()
    it = ledger_store.raw_batches(batch=4)
    assert [r[0] for r in next(it)] == [1, 2, 3, 4]
    it.close()
    deadline = time.monotonic() + 5
    while _prefetch_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _prefetch_threads() == before


def test_an_error_while_prefetching_reaches_the_reader(ledger_store, rng):
    from residency.ledger import LedgerError

    ledger_store.append(random_items(rng, rng.randint(30, 50)))
    it = ledger_store.raw_batches(batch=3)
    next(it)
    ledger_store.close()
    with pytest.raises(LedgerError, match="is closed"):
        for _ in it:
            pass


# ---------------------------------------------------------------------- what the writer remembers
def _append_elsewhere(store, items) -> list[int]:
    """Append as another writer does (a second store, another process): the same database, on a
    connection of its own (SQLite in memory: the one connection), none of this store's memory."""
    from residency.ledger import append as _append

    raw = store._raw
    with raw.write_lock, raw.cursor("appending elsewhere") as (conn, cur):
        raw.dialect.begin_write(cur, "normal")
        seqs = _append.write(cur, raw.dialect, _append.prepare(items))
        conn.commit()
    return seqs


def test_rows_another_writer_appended_meanwhile_are_chained_after_never_over(ledger_store, rng):
    """The store numbers from the tail it remembers; another writer's rows make that tail stale,
    the database refuses the seq, and the store writes again from the real tail."""
    ours, theirs = random_items(rng, 30), random_items(rng, 10)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    assert ledger_store.append(ours[:a]) == list(range(1, a + 1))
    assert ledger_store.append(ours[a:a + b]) == list(range(a + 1, a + b + 1))     # from the remembered tail
    k = rng.randint(1, 10)
    assert _append_elsewhere(ledger_store, theirs[:k]) == list(range(a + b + 1, a + b + k + 1))
    n = a + b + k
    assert ledger_store.append(ours[a + b:]) == list(range(n + 1, n + 1 + 30 - a - b))
    assert ledger_store.append(theirs[k:]) == list(range(n + 31 - a - b, 41))
    assert [r.event for r in ledger_store.read()] == [e for _, e in ours[:a + b] + theirs[:k] + ours[a + b:] + theirs[k:]]
    report = ledger_store.verify()
    assert report.ok and report.num_events == 40


def test_a_triple_another_writer_stored_is_still_a_retry_the_store_never_looked_up(ledger_store, rng):
    """The store skips the lookup for triples beyond what it has seen; the unique index on the
    triple refuses a repeat it did not know of, and the store answers it as any retry."""
    theirs = random_items(rng, 3)
    assert _append_elsewhere(ledger_store, theirs) == [1, 2, 3]
    ours = random_items(rng, 4)
    assert ledger_store.append(ours[:2]) == [4, 5]          # the tail is now remembered, and fresh
    assert ledger_store.append([ours[2], theirs[1], ours[3]]) == [6, 2, 7]
    env, ev = theirs[2]
    other = random_event(rng, type(ev).__name__)
    while other == ev:
        other = random_event(rng, type(ev).__name__)
    with pytest.raises(LedgerConflict, match=f"producer_seq {env.producer_seq} is already seq 3"):
        ledger_store.append([(env, other)])
    assert ledger_store.append(random_items(rng, 1)) == [8]    # a refused batch leaves no hole
    report = ledger_store.verify()
    assert report.ok and report.num_events == 8


def test_a_conflicting_batch_leaves_the_next_append_gapless(ledger_store, rng):
    items = random_items(rng, 6)
    assert ledger_store.append(items[:4]) == [1, 2, 3, 4]
    env, ev = items[1]
    with pytest.raises(LedgerConflict):
        ledger_store.append([items[4], (env, random_event(rng, "ServerStopped" if type(ev).__name__ != "ServerStopped"
                                                            else "StateCheckpoint"))])
    assert ledger_store.append(items[4:]) == [5, 6]
    assert ledger_store.verify().ok


@pytest.mark.postgres
def test_a_lost_writing_connection_costs_one_append_not_the_store(pg_schema_url, pg_admin, rng):
    """The store keeps one connection for its writes: when the server drops it, that append fails
    (LedgerError, nothing written) and the next one opens a fresh connection."""
    from sqlalchemy import text

    from residency.ledger import LedgerError

    with LedgerStore.open(pg_schema_url, create=True) as store:
        items = random_items(rng, 9)
        assert store.append(items[:3]) == [1, 2, 3]
        pid = store._raw._kept[0].dbapi_connection.info.backend_pid
        with pg_admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
        with pytest.raises(LedgerError):
            store.append(items[3:6])
        assert store.append(items[3:]) == [4, 5, 6, 7, 8, 9]
        report = store.verify()
        assert report.ok and report.num_events == 9


def test_a_postgresql_append_whose_tail_is_known_is_one_round_trip(pg_schema_url, rng, tmp_path):
    """BEGIN, SET LOCAL and the lock ride in the insert's pipeline with the rows and COMMIT:
    libpq's trace of the second append shows one Sync and no simple Query (each is a round trip)."""
    from psycopg import pq

    with LedgerStore.open(pg_schema_url, create=True) as store:
        items = random_items(rng, 3)
        assert store.append(items[:1]) == [1]            # now the writer knows the tail
        pg = store._raw._kept[0].driver_connection.pgconn
        trace = tmp_path / "libpq.trace"
        with open(trace, "w") as f:
            pg.trace(f.fileno())
            pg.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            assert store.append(items[1:]) == [2, 3]
            pg.untrace()
        sent = [line.split("\t") for line in trace.read_text().splitlines() if line.startswith("F")]
        kinds = [parts[2].split()[0] for parts in sent]
        assert kinds.count("Sync") + kinds.count("Query") == 1, kinds
        assert any('"BEGIN"' in "\t".join(p) for p in sent) and any('"COMMIT"' in "\t".join(p) for p in sent)
        assert store.verify().ok
