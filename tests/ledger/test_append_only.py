"""The database itself refuses to change or remove events; snapshots stay deletable."""
from __future__ import annotations

import pytest
from sqlalchemy import exc, text

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
    filled.save_snapshot(filled.last_seq(), rng.randbytes(100), "h")
    with filled.engine.begin() as conn:
        conn.execute(text("DELETE FROM snapshots"))
    assert filled.load_snapshot(filled.last_seq()) is None
