"""GroupCommitWriter: batched commits, futures that resolve to seqs, back-pressure that never drops."""
from __future__ import annotations

import threading
import time

import pytest
import structlog

import residency.ledger.writer as writer_mod
from residency.ledger import GroupCommitWriter, LedgerConflict, LedgerError
from tests.ledger.factories import random_event, random_items


def test_many_producers_get_gapless_seqs_in_fewer_commits(ledger_store, rng):
    num_producers, per_producer = 4, 60
    plans = [random_items(rng, per_producer, producer=f"worker:{i}", epoch=7) for i in range(num_producers)]
    futures: dict[int, list] = {}
    with GroupCommitWriter(ledger_store, max_batch=50, max_delay_s=0.005) as writer:
        def produce(i):
            futures[i] = [writer.submit(env, ev) for env, ev in plans[i]]
        threads = [threading.Thread(target=produce, args=(i,)) for i in range(num_producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        writer.flush()
        stats = writer.stats()
    total = num_producers * per_producer
    seqs = {i: [f.result(timeout=5) for f in fs] for i, fs in futures.items()}
    assert sorted(s for v in seqs.values() for s in v) == list(range(1, total + 1))
    for v in seqs.values():
        assert v == sorted(v)                     # a producer's events keep their order
    assert stats["events"] == total and stats["queue_depth"] == 0 and stats["failed"] == 0
    assert 1 <= stats["batches"] < total          # grouped
    assert stats["max_lag_s"] > 0
    assert ledger_store.verify().ok


class SlowStore:
    """The real store, made slow, so the queue fills."""

    def __init__(self, store, delay_s):
        self.store, self.delay_s = store, delay_s

    def append(self, items, **kw):
        time.sleep(self.delay_s)
        return self.store.append(items, **kw)


def test_a_full_queue_blocks_counts_and_logs_and_never_drops(ledger_store, rng, monkeypatch):
    items = random_items(rng, rng.randint(40, 60))
    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(writer_mod, "log", structlog.get_logger("ledger.writer"))
        writer = GroupCommitWriter(SlowStore(ledger_store, 0.01), max_batch=3, max_delay_s=0, max_queue=4)
        futures = [writer.submit(env, ev) for env, ev in items]     # blocks whenever 4 are waiting
        writer.close()
    stats = writer.stats()
    assert [f.result(timeout=10) for f in futures] == list(range(1, len(items) + 1))
    assert stats["backpressure_waits"] > 0 and stats["events"] == len(items)
    bp = [e for e in logs if e["event"] == "ledger_backpressure"]
    assert bp and bp[0]["log_level"] == "warning" and bp[0]["max_queue"] == 4
    assert ledger_store.last_seq() == len(items)


def test_a_conflicting_retry_fails_only_its_own_future(ledger_store, rng):
    stored = random_items(rng, 5, exclude=("ServerStopped",))
    ledger_store.append(stored)
    env, ev = stored[rng.randrange(5)]
    fresh = random_items(rng, 8)
    with GroupCommitWriter(ledger_store, max_batch=100, max_delay_s=0.05) as writer:
        good = [writer.submit(e, v) for e, v in fresh[:4]]
        bad = writer.submit(env, random_event(rng, "ServerStopped"))
        good += [writer.submit(e, v) for e, v in fresh[4:]]
        writer.flush()
        assert writer.stats()["failed"] == 1
    with pytest.raises(LedgerConflict):
        bad.result(timeout=10)
    assert [f.result(timeout=10) for f in good] == list(range(6, 14))
    assert ledger_store.verify().ok


def test_when_the_database_goes_away_every_future_of_the_batch_gets_the_error(ledger_store, rng):
    writer = GroupCommitWriter(ledger_store, max_delay_s=0.01)
    ledger_store.close()
    futures = [writer.submit(e, v) for e, v in random_items(rng, 5)]
    writer.flush()
    for f in futures:
        with pytest.raises(LedgerError, match="closed"):
            f.result(timeout=10)
    writer.close()


def test_close_commits_what_is_queued_then_refuses_more(ledger_store, rng):
    items = random_items(rng, 30)
    writer = GroupCommitWriter(ledger_store, max_batch=7, max_delay_s=0.05)
    futures = [writer.submit(e, v) for e, v in items[:-1]]
    writer.close()
    assert all(f.done() for f in futures) and ledger_store.last_seq() == 29
    with pytest.raises(LedgerError, match="closed"):
        writer.submit(*items[-1])


def test_the_writer_checks_its_arguments(ledger_store, rng):
    with pytest.raises(ValueError, match="durability"):
        GroupCommitWriter(ledger_store, durability="sometimes")
    with GroupCommitWriter(ledger_store, durability="full") as writer:
        with pytest.raises(TypeError, match="submit takes"):
            writer.submit(random_items(rng, 1)[0][0], "MoveAcked")
        env, ev = random_items(rng, 1)[0]
        assert writer.submit(env, ev).result(timeout=5) == 1


def test_warming_the_writer_writes_nothing_and_steps_aside_for_a_writing_thread(ledger_store, rng):
    """``warm_writer`` opens a write transaction, reads the tail and rolls back: the ledger is
    unchanged (rows, tail, chain), the next append numbers on from the tail, and while another
    thread holds the write lock it does nothing rather than wait."""
    seqs = ledger_store.append(random_items(rng, 5), durability="normal")
    before = [(r.seq, r.row_hash) for r in ledger_store.read()]
    assert ledger_store.warm_writer("normal") is True
    assert ledger_store.warm_writer("full", payload_bytes=8192) is True      # a row inserted, rolled back
    assert [(r.seq, r.row_hash) for r in ledger_store.read()] == before
    assert ledger_store.append(random_items(rng, 2), durability="normal") == [seqs[-1] + 1, seqs[-1] + 2]
    lock = ledger_store._raw.write_lock
    with lock:
        got = []
        t = threading.Thread(target=lambda: got.append(ledger_store.warm_writer()))
        t.start()
        t.join(5)
        assert got == [False]
    assert ledger_store.verify().ok
