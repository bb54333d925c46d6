"""Replay's fast read paths (packed runs decoded in one call; payload runs, decoded as each
row's type; fold_run) against the reference (every row through decode_event, then
fold_decoded), on every backend."""
from __future__ import annotations

import sqlite3

import msgspec
import pytest
from sqlalchemy import event

from residency.ledger import store as ledger_store
from residency.control.fold import fold_decoded
from residency.control.replay import ReplayError, replay
from residency.control.simulate import simulate
from residency.control.state import State, state_hash
from residency.events.catalog import BlocksFreed
from residency.events.codec import current_decoders, decode_event, decode_packed
from residency.ledger import LedgerStore
from residency.ledger.chain import row_hash
from residency.ledger.schema import PackedRun, PayloadRun
from tests.ledger.tamper import insert_row, run_unguarded


def reference(store, to_seq=None) -> State:
    """The slow, obvious replay: every row decoded by decode_event, folded with its seq and time."""
    return fold_decoded(State(), ((r.seq, r.ts_ns, decode_event(r.payload, r.type, r.schema_version))
                                  for r in store.read_raw(1, to_seq)))


@pytest.fixture
def small_batches(monkeypatch, rng):
    """Read in small, irregular batches so one replay crosses many runs (and the prefetch thread)."""
    monkeypatch.setattr(ledger_store, "READ_BATCH", rng.randint(7, 300))


def _simulated(store, rng, n):
    items = list(simulate(n, seed=rng.randrange(1 << 30)))
    for k in range(0, n, 997):
        store.append(items[k:k + 997], durability="normal")


def test_the_fast_path_equals_the_row_by_row_reference(ledger_store, rng, small_batches):
    n = rng.randint(1500, 4000)
    _simulated(ledger_store, rng, n)
    for to_seq in (n, rng.randint(1, n - 1)):
        want = reference(ledger_store, to_seq)
        got, _ = replay(ledger_store, to_seq, use_snapshots=False)
        assert state_hash(got) == state_hash(want)
        assert (got.last_seq, got.last_ts_ns, got.anomalies, got.checkpoints) == \
            (want.last_seq, want.last_ts_ns, want.anomalies, want.checkpoints)


def test_payload_runs_are_gapless_and_carry_the_last_rows_time(ledger_store, rng, small_batches):
    _simulated(ledger_store, rng, 700)
    rows = list(ledger_store.read_raw())
    seq = 1
    for run in ledger_store.payload_runs(1, 700):
        assert isinstance(run, PayloadRun) and run.first_seq == seq
        assert list(run.rows) == [(r.type, r.schema_version, r.payload) for r in rows[seq - 1:run.last_seq]]
        assert run.last_ts_ns == rows[run.last_seq - 1].ts_ns
        seq = run.last_seq + 1
    assert seq == 701


def test_packed_runs_hold_what_the_rows_hold(ledger_store, rng, small_batches):
    _simulated(ledger_store, rng, 700)
    if ledger_store.backend != "sqlite":        # PostgreSQL sends rows (see LedgerStore.packed_runs)
        assert list(ledger_store.packed_runs(1, 700)) == list(ledger_store.payload_runs(1, 700))
        return
    rows = list(ledger_store.read_raw())
    seq = 1
    for run in ledger_store.packed_runs(1, 700):
        assert isinstance(run, PackedRun) and run.first_seq == seq
        mine = rows[seq - 1:run.last_seq]
        assert run.payloads == b"".join(r.payload for r in mine)
        assert run.types == ",".join(r.type for r in mine)
        assert run.lengths == ", ".join(str(len(r.payload)) for r in mine)
        assert run.last_ts_ns == mine[-1].ts_ns
        assert decode_packed(run.num_rows, run.payloads, run.types, run.lengths) == \
            [decode_event(r.payload, r.type, r.schema_version) for r in mine]
        seq = run.last_seq + 1
    assert seq == 701


def test_sqlite_packs_a_run_by_walking_its_seqs_in_order(ledger_store):
    # the packed statement has no ORDER BY (see ledger.store._packed_sql): the plan must stay a
    # walk of the rowid range, forwards
    if ledger_store.backend != "sqlite":
        pytest.skip("PostgreSQL orders inside its aggregates")
    with ledger_store.engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + ledger_store._packed_sql, (5, 1, 5)).all()
        assert conn.exec_driver_sql("PRAGMA reverse_unordered_selects").scalar() == 0
    assert plan[0][-1] == "SEARCH events USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)"


def _corrupt(store, seq: int, payload: bytes) -> None:
    run_unguarded(store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": payload, "s": seq})


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other_type", "trailing_byte", "slid_into_the_next_row"])
def test_a_payload_that_does_not_decode_is_named_by_its_seq(ledger_store, rng, small_batches, damage):
    _simulated(ledger_store, rng, 1200)
    rows = list(ledger_store.read_raw())
    if damage == "slid_into_the_next_row":
        # the first byte of the next row (of the same type) moved to the end of this one: the
        # concatenation of the payloads, and the type of every row, are as they were
        bad = rng.choice([x.seq for x, y in zip(rows[1:], rows[2:]) if x.type == y.type])
        _corrupt(ledger_store, bad + 1, rows[bad].payload[1:])
    else:
        bad = rng.randint(2, 1199)
    r = rows[bad - 1]
    other = next(x for x in rows if x.type != r.type)
    payload = {"truncated": r.payload[:-1], "garbage": b"\xc1\xc1\xc1", "other_type": other.payload,
               "trailing_byte": r.payload + b"\x00", "slid_into_the_next_row": r.payload + rows[bad].payload[:1]}[damage]
    _corrupt(ledger_store, bad, payload)
    with pytest.raises(ReplayError) as err:
        replay(ledger_store, use_snapshots=False)
    try:
        decode_event(payload, r.type, r.schema_version)
    except Exception as e:  # the words of the row-by-row path, the seq in front
        assert str(err.value) == f"seq {bad}: {e}"
    else:
        pytest.fail("the damaged payload decodes")
    if damage == "other_type":
        assert f"row says {r.type} but payload is {other.type}" in str(err.value)


def test_an_older_schema_row_in_a_run_is_upcast(ledger_store, rng, small_batches):
    _simulated(ledger_store, rng, 500)
    last = list(ledger_store.read_raw())[-1]
    v1 = msgspec.msgpack.encode(["BlocksFreed", 0, [rng.randrange(1 << 20)], 0, "dropped"])  # v1: no tier
    row = (last.seq + 1, last.ts_ns + 1, "control", 1, 1 << 40, "BlocksFreed", 1, None, None, v1)
    insert_row(ledger_store, (*row, row_hash(last.row_hash, row)))
    assert current_decoders([("BlocksFreed", 1, v1)]) is None
    assert type(list(ledger_store.packed_runs(1, last.seq + 1))[-1]) is PayloadRun     # not packed: upcast
    got, _ = replay(ledger_store, use_snapshots=False)
    want = reference(ledger_store)
    assert state_hash(got) == state_hash(want) and got.last_seq == last.seq + 1
    assert decode_event(v1, "BlocksFreed", 1) == BlocksFreed(worker=0, tier="device", blocks=list(msgspec.msgpack.decode(v1)[2]),
                                                             bytes=0, reason="dropped")


def test_a_gap_is_read_row_by_row_with_its_real_seqs(ledger_store, rng, small_batches):
    _simulated(ledger_store, rng, 600)
    gone = rng.randint(2, 599)
    run_unguarded(ledger_store, "DELETE FROM events WHERE seq = :s", {"s": gone})
    kinds = [type(b) for b in ledger_store.payload_runs(1, 600)]
    assert list in kinds and PayloadRun in kinds
    kinds = [type(b) for b in ledger_store.packed_runs(1, 600)]
    assert list in kinds and (PackedRun if ledger_store.backend == "sqlite" else PayloadRun) in kinds
    got, _ = replay(ledger_store, use_snapshots=False)
    want = reference(ledger_store)
    assert state_hash(got) == state_hash(want)
    assert (got.last_seq, got.anomalies) == (want.last_seq, want.anomalies)


def test_a_run_too_big_for_one_database_value_is_read_row_by_row(tmp_path, rng):
    # SQLite builds no value over SQLITE_LIMIT_LENGTH (1 GB by default; PostgreSQL stops at 1 GB
    # too): here 4 KiB, so every packed run is too big, while each row still fits
    with LedgerStore.open(f"sqlite:///{tmp_path / 'ledger.db'}", create=True) as store:
        _simulated(store, rng, 1500)
        event.listen(store.engine, "connect", lambda conn, _: conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096))
        store.engine.dispose()
        assert {type(r) for r in store.packed_runs(1, 1500, batch=500)} == {PayloadRun}
        got, _ = replay(store, use_snapshots=False)
        assert state_hash(got) == state_hash(reference(store)) and got.last_seq == 1500
