"""verify() names the first bad seq for every kind of damage, on every backend."""
from __future__ import annotations

import sqlite3

import pytest

from residency.events import encode_event
from residency.ledger import LedgerCorrupt, LedgerStore
from residency.ledger.chain import GENESIS, row_hash
from tests.ledger.factories import envelope, random_event, random_items
from tests.ledger.tamper import rechain, run_unguarded


@pytest.fixture
def filled(ledger_store, rng):
    n = rng.randint(30, 60)
    ledger_store.append(random_items(rng, n))
    assert ledger_store.verify().ok
    return ledger_store, n


def test_a_sound_ledger_verifies_and_reports_progress_and_its_last_hash(filled):
    store, n = filled
    seen = []
    report = store.verify(progress=lambda done, total: seen.append((done, total)))
    assert report.ok and report.num_events == n and report.first_bad_seq is None and report.problem is None
    assert report.last_hash == list(store.read_raw())[-1].row_hash
    assert seen[-1] == (n, n)


def test_a_flipped_payload_bit_is_named_by_its_seq(filled, rng):
    store, n = filled
    seq = rng.randint(1, n)
    payload = bytearray(store.peek_raw(seq)[9])
    i = rng.randrange(len(payload))
    payload[i] ^= 1 << rng.randrange(8)
    run_unguarded(store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": bytes(payload), "s": seq})
    report = store.verify()
    assert not report.ok and report.first_bad_seq == seq and report.num_events == seq - 1
    assert report.problem.startswith(f"seq {seq}: ")
    if seq < n:
        assert "edited after it was written" in report.problem
    else:
        assert "it is the last row" in report.problem


def test_an_edited_hash_is_named_by_its_seq(filled, rng):
    store, n = filled
    seq = rng.randint(1, n - 1)
    run_unguarded(store, "UPDATE events SET row_hash = :h WHERE seq = :s", {"h": rng.randbytes(32), "s": seq})
    report = store.verify()
    assert report.first_bad_seq == seq
    assert report.problem == f"seq {seq}: its stored row_hash was altered (seq {seq + 1} chains from the hash its contents imply)"


def test_a_missing_seq_is_named(filled, rng):
    store, n = filled
    seq = rng.randint(1, n - 1)
    run_unguarded(store, "DELETE FROM events WHERE seq = :s", {"s": seq})
    report = store.verify()
    assert report.first_bad_seq == seq and not report.ok
    where = "first" if seq == 1 else "next"
    assert report.problem == f"seq {seq} is missing (the {where} stored row is seq {seq + 1})"


def test_an_unknown_event_type_is_named_even_with_a_forged_chain(filled, rng):
    store, n = filled
    seq = rng.randint(1, n)
    run_unguarded(store, "UPDATE events SET type = :t WHERE seq = :s", {"t": "MoveTeleported", "s": seq})
    rechain(store, seq)
    report = store.verify()
    assert report.first_bad_seq == seq
    assert report.problem == f"seq {seq}: unknown event type 'MoveTeleported'"
    with pytest.raises(LedgerCorrupt, match=f"seq {seq}"):
        list(store.read())


def test_a_payload_swapped_under_another_type_is_named(filled, rng):
    store, n = filled
    seq = rng.randint(1, n)
    row = store.peek_raw(seq)
    other = random_event(rng, "ServerStopped" if row[5] != "ServerStopped" else "ServerStarted")
    run_unguarded(store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": encode_event(other), "s": seq})
    rechain(store, seq)
    report = store.verify()
    assert report.first_bad_seq == seq
    assert report.problem == f"seq {seq}: row says {row[5]} but payload is {type(other).__name__}"


def test_a_payload_that_is_not_msgpack_is_named(filled, rng):
    store, n = filled
    seq = rng.randint(1, n)
    run_unguarded(store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": b"\xc1" + rng.randbytes(9), "s": seq})
    rechain(store, seq)
    report = store.verify()
    assert report.first_bad_seq == seq and report.problem.startswith(f"seq {seq}: payload does not decode")


def test_a_row_rewritten_with_its_own_hash_breaks_the_next_link(filled, rng):
    store, n = filled
    seq = rng.randint(1, n - 2)          # seq + 1 is not the last row: that case is worded apart
    row = store.peek_raw(seq)
    run_unguarded(store, "UPDATE events SET ts_ns = :t WHERE seq = :s", {"t": row[1] + rng.randint(1, 10**6), "s": seq})
    prev = store.peek_raw(seq - 1)[10] if seq > 1 else GENESIS
    run_unguarded(store, "UPDATE events SET row_hash = :h WHERE seq = :s", {"h": row_hash(prev, store.peek_raw(seq)), "s": seq})
    report = store.verify()
    assert report.first_bad_seq == seq + 1
    assert "or the row before it was rewritten together with its hash" in report.problem


def test_a_forged_suffix_verifies_but_changes_last_hash(filled, rng):
    store, n = filled
    anchor = store.verify().last_hash          # what a careful operator keeps elsewhere
    seq = rng.randint(1, n)
    run_unguarded(store, "UPDATE events SET producer = :p WHERE seq = :s", {"p": "mallory", "s": seq})
    rechain(store, seq)
    report = store.verify()
    assert report.ok and report.last_hash != anchor


def test_state_checkpoints_are_handed_to_the_caller(ledger_store, rng):
    items = random_items(rng, 12, exclude=("StateCheckpoint",))
    checkpoint_at = sorted(rng.sample(range(12), 3))
    for i in checkpoint_at:
        env, _ = items[i]
        items[i] = (env, random_event(rng, "StateCheckpoint", through_seq=i))
    ledger_store.append(items)
    report = ledger_store.verify()
    assert report.ok
    assert report.checkpoints == [(i + 1, i, items[i][1].state_hash) for i in checkpoint_at]


def test_a_row_edited_through_raw_sqlite3_after_dropping_the_trigger(tmp_path, rng):
    path = tmp_path / "ledger.db"
    with LedgerStore.open(f"sqlite:///{path}", create=True) as store:
        store.append(random_items(rng, 40))
    seq = rng.randint(1, 39)
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("UPDATE events SET producer = 'mallory' WHERE seq = ?", (seq,))
    conn.execute("DROP TRIGGER events_no_update")
    conn.execute("UPDATE events SET producer = 'mallory' WHERE seq = ?", (seq,))
    conn.commit()
    conn.close()
    with LedgerStore.open(f"sqlite:///{path}") as store:
        report = store.verify()
    assert report.first_bad_seq == seq and "edited after it was written" in report.problem


def _tamper(kind: str, store, n: int, rng) -> None:
    seq = rng.randint(2, n - 1)
    if kind == "flipped":
        payload = bytearray(store.peek_raw(seq)[9])
        payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        run_unguarded(store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": bytes(payload), "s": seq})
    elif kind == "hash":
        run_unguarded(store, "UPDATE events SET row_hash = :h WHERE seq = :s", {"h": rng.randbytes(32), "s": seq})
    elif kind == "missing":
        # never the last row: a ledger missing its tail is a valid shorter ledger (hence last_hash anchors)
        run_unguarded(store, "DELETE FROM events WHERE seq BETWEEN :a AND :b",
                      {"a": seq, "b": min(seq + rng.randint(0, 3), n - 1)})
    elif kind == "unknown":
        run_unguarded(store, "UPDATE events SET type = 'MoveTeleported' WHERE seq = :s", {"s": seq})
        rechain(store, seq)


@pytest.fixture
def checkpointed(ledger_store, rng):
    items = random_items(rng, rng.randint(40, 70), exclude=("StateCheckpoint",))
    for i in rng.sample(range(len(items)), 3):
        items[i] = (items[i][0], random_event(rng, "StateCheckpoint"))
    ledger_store.append(items)
    return ledger_store, len(items)


@pytest.mark.parametrize("kind", ["sound", "flipped", "hash", "missing", "unknown", "boundary"])
def test_verifying_in_ranges_reaches_the_same_verdict_as_one_pass(checkpointed, rng, kind):
    """The parallel split, run in-process: each range from its predecessor's stored hash, combined."""
    from residency.ledger.verify_parallel import combine, jobs, split, verify_range

    store, n = checkpointed
    if kind == "boundary":          # the tail of the first of two ranges is gone
        end = split(n, 2)[0][1]
        run_unguarded(store, "DELETE FROM events WHERE seq BETWEEN :a AND :b", {"a": end - rng.randint(0, 2), "b": end})
    elif kind != "sound":
        _tamper(kind, store, n, rng)
    one = store.verify(workers=1)
    total = store.last_seq()
    for workers in (2, rng.randint(3, 9)):   # 2 first: "boundary" is cut for it
        assert combine([verify_range(store, *job) for job in jobs(store, total, workers)]) == one
    assert one.ok == (kind == "sound")


def test_parallel_verify_in_worker_processes(checkpointed, rng):
    store, n = checkpointed
    if store.url == "sqlite:///:memory:":
        pytest.skip("an in-memory ledger cannot be shared with worker processes")
    _tamper("missing", store, n, rng)
    seen = []
    many = store.verify(workers=2, progress=lambda done, total: seen.append(done))
    assert many == store.verify(workers=1) and not many.ok
    assert seen and seen == sorted(seen)


def test_a_failing_worker_falls_back_to_one_pass_and_says_so(tmp_path, rng, monkeypatch):
    import structlog

    import residency.ledger.verify_parallel as vp

    with LedgerStore.open(f"sqlite:///{tmp_path / 'l.db'}", create=True) as store:
        store.append(random_items(rng, 30))
        monkeypatch.setattr(vp, "_WORKER", "import sys; sys.exit(3)")
        with structlog.testing.capture_logs() as logs:
            monkeypatch.setattr(vp, "log", structlog.get_logger("ledger.verify"))
            report = store.verify(workers=2)
    assert report.ok and report.num_events == 30
    # two ranges: this process verified the first, the one child died
    assert [e["returncode"] for e in logs if e["event"] == "ledger_verify_parallel_failed"] == [3]


def test_reads_step_over_a_gap_wider_than_a_batch(filled, rng):
    store, n = filled
    a = rng.randint(2, n - 10)
    b = a + rng.randint(3, 8)
    run_unguarded(store, "DELETE FROM events WHERE seq BETWEEN :a AND :b", {"a": a, "b": b})
    left = [s for s in range(1, n + 1) if not a <= s <= b]
    assert [r[0] for rows in store.raw_batches(batch=3) for r in rows] == left
    assert store.verify().problem == f"seq {a} is missing (the next stored row is seq {b + 1})"


def test_the_sqlite_worker_reads_the_columns_the_store_reads():
    from residency.ledger.schema import EVENT_COLUMNS
    from residency.ledger.verify_parallel import EVENT_COLUMNS as worker_columns
    assert worker_columns == EVENT_COLUMNS


@pytest.mark.parametrize("kind", ["sound", "flipped", "hash", "missing", "unknown"])
def test_parallel_verify_on_sqlite_uses_no_sqlalchemy_in_its_workers_and_agrees(tmp_path, rng, kind, monkeypatch):
    """Child processes on an SQLite file (plain sqlite3, read-only) reach one pass's verdict,
    and really are the lean kind: the worker fails if SQLAlchemy gets imported."""
    import residency.ledger.verify_parallel as vp

    monkeypatch.setattr(vp, "_WORKER", "import sys; sys.modules['sqlalchemy'] = None; " + vp._WORKER)
    with LedgerStore.open(f"sqlite:///{tmp_path / 'l.db'}", create=True) as store:
        items = random_items(rng, rng.randint(60, 120), exclude=("StateCheckpoint",))
        for i in rng.sample(range(len(items)), 3):
            items[i] = (items[i][0], random_event(rng, "StateCheckpoint"))
        store.append(items)
        n = len(items)
        if kind != "sound":
            _tamper(kind, store, n, rng)
        one = store.verify(workers=1)
        for workers in (2, rng.randint(3, 5)):
            assert vp.verify_parallel(store, store.last_seq(), workers, None) == one
        assert one.ok == (kind == "sound")


@pytest.mark.parametrize("column", ["bytes", "worker", "tier", "move_id", "session", "kind"])
def test_an_edited_audit_column_fails_verify_naming_the_seq(ledger_store, rng, column):
    """The audit columns are outside the hash: an edit (a 4 MiB move reported as 390 GiB) must
    still fail verify, at the seq edited, on one pass and on parallel ranges alike."""
    n = rng.randint(20, 60)
    ledger_store.append(random_items(rng, n))
    ev = random_event(rng, "MoveRequested", bytes_planned=4 << 20)     # fills all six audit columns
    [seq] = ledger_store.append([(envelope(rng, "control", 1, 1), ev)])
    ledger_store.append(random_items(rng, rng.randint(0, 5), producer="after"))
    assert ledger_store.verify().ok
    forged = {"bytes": 390 << 30, "worker": ev.worker + 1, "tier": ev.src + "x", "move_id": "m-forged",
              "session": "s-forged", "kind": "forged"}[column]
    run_unguarded(ledger_store, f"UPDATE events SET {column} = :v WHERE seq = :s", {"v": forged, "s": seq})
    for workers in (1, 3):
        report = ledger_store.verify(workers=workers)
        assert not report.ok and report.first_bad_seq == seq and report.num_events == seq - 1
        assert f"seq {seq}: its audit columns were edited ({column} is {forged!r}" in report.problem


def test_an_older_rows_columns_may_lack_what_an_upcast_fills_but_may_not_disagree(ledger_store, rng):
    """BlocksFreed v1 had no tier: its row's tier column is NULL while the upcast event says
    "device". That is sound; a bytes column that disagrees with the payload is not."""
    import msgspec

    from tests.ledger.tamper import insert_row

    ledger_store.append(random_items(rng, rng.randint(1, 10)))
    last = list(ledger_store.read_raw())[-1]
    worker, num_bytes = rng.randrange(8), rng.randrange(1 << 40)
    payload = msgspec.msgpack.encode(["BlocksFreed", worker, [rng.randrange(1 << 20)], num_bytes, "finished"])
    row = (last.seq + 1, rng.randrange(1 << 62), "control", 1, rng.randrange(1 << 40), "BlocksFreed", 1,
           None, None, payload)
    columns = ("seq", "ts_ns", "producer", "epoch", "producer_seq", "type", "schema_version", "correlation_id",
               "causation", "payload", "row_hash", "worker", "kind", "bytes")
    insert_row(ledger_store, (*row, row_hash(last.row_hash, row), worker, "finished", num_bytes), columns)
    assert ledger_store.verify().ok
    run_unguarded(ledger_store, "UPDATE events SET bytes = :b WHERE seq = :s", {"b": num_bytes + 1, "s": row[0]})
    report = ledger_store.verify()
    assert report.first_bad_seq == row[0] and "bytes is" in report.problem
