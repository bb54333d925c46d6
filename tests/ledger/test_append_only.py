"""The database itself refuses to change or remove events; snapshots stay deletable."""
from __future__ import annotations

import time

import pytest
from sqlalchemy import exc, text

from residency.events import Envelope
from residency.events.catalog import StateCheckpoint
from tests.ledger.factories import random_items


@pytest.fixture
def filled(ledger_store, rng):
    ledger_store.append(random_items(rng, rng.randint(5, 20)))
    return ledger_store


@pytest.mark.parametrize("sql", [
    "UPDATE events SET producer = 'mallory' WHERE seq = 1",
    "UPDATE events SET payload = payload",
    "DELETE FROM events WHERE seq = 1",
    "DELETE FROM events",
])
def test_plain_sql_cannot_update_or_delete_events(filled, sql):
    before = list(filled.read_raw())
    with pytest.raises(exc.DBAPIError, match="append-only"):
        with filled.engine.begin() as conn:
            conn.execute(text(sql))
    assert list(filled.read_raw()) == before
    assert filled.verify().ok


def test_postgres_refuses_truncate_and_even_updates_that_match_nothing(filled):
    if filled.backend != "postgresql":
        pytest.skip("TRUNCATE and statement-level triggers are PostgreSQL's")
    n = filled.last_seq()
    with pytest.raises(exc.DBAPIError, match="append-only: TRUNCATE rejected"):
        with filled.engine.begin() as conn:
            conn.execute(text("TRUNCATE events"))
    with pytest.raises(exc.DBAPIError, match="append-only: UPDATE rejected"):
        with filled.engine.begin() as conn:
            conn.execute(text("UPDATE events SET producer = 'x' WHERE seq < 0"))
    assert filled.last_seq() == n


def test_snapshots_are_a_cache_and_may_be_deleted(filled, rng):
    through = filled.last_seq()
    env = Envelope(producer="test-checkpoints", epoch=1, producer_seq=1, ts_ns=time.time_ns())
    [cp] = filled.append([(env, StateCheckpoint(through_seq=through, state_hash="h"))])
    filled.save_snapshot(through, rng.randbytes(100), "h", cp)
    with filled.engine.begin() as conn:
        conn.execute(text("DELETE FROM snapshots"))
    assert filled.load_snapshot(filled.last_seq()) is None


_COLUMNS = ("seq, ts_ns, producer, epoch, producer_seq, type, schema_version, correlation_id, causation, "
            "payload, row_hash, move_id, worker, session, tier, kind, bytes")


def _overwrites(backend: str, n: int) -> list[str]:
    """Statements that would put another row where a stored one is, each on its own key."""
    same_seq = f"SELECT seq, ts_ns, 'mallory', epoch, producer_seq, type, schema_version, correlation_id, " \
               f"causation, payload, row_hash, move_id, worker, session, tier, kind, bytes FROM events WHERE seq = 1"
    same_triple = f"SELECT {n + 1}, ts_ns, producer, epoch, producer_seq, type, schema_version, correlation_id, " \
                  f"causation, payload, row_hash, move_id, worker, session, tier, kind, 999999 FROM events WHERE seq = 2"
    if backend == "sqlite":
        return [f"INSERT OR REPLACE INTO events ({_COLUMNS}) {same_seq}",
                f"REPLACE INTO events ({_COLUMNS}) {same_triple}",
                "UPDATE OR REPLACE events SET seq = 1 WHERE seq = 2"]
    return [f"INSERT INTO events ({_COLUMNS}) {same_seq} ON CONFLICT (seq) DO UPDATE SET producer = 'mallory'",
            f"INSERT INTO events ({_COLUMNS}) {same_triple} "
            f"ON CONFLICT (producer, epoch, producer_seq) DO UPDATE SET bytes = 999999"]


def test_insert_or_replace_cannot_overwrite_a_stored_row(filled):
    """SQLite's REPLACE deletes the conflicting row without firing DELETE triggers; PostgreSQL's
    ON CONFLICT DO UPDATE is an update. Neither may rewrite the ledger."""
    before = list(filled.read_raw())
    for sql in _overwrites(filled.engine.dialect.name, len(before)):
        with pytest.raises(exc.DBAPIError, match="append-only"):
            with filled.engine.begin() as conn:
                conn.execute(text(sql))
    assert list(filled.read_raw()) == before
    assert filled.verify().ok
