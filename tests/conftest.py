"""Shared fixtures: the ledger backends every backend-contract suite runs against.

``ledger_url`` is parametrized over SQLite in a file, SQLite in memory and PostgreSQL; each test
gets a fresh, empty database. PostgreSQL runs when RESIDENCY_TEST_PG_URL is set (CI sets it to
postgresql+psycopg://root@127.0.0.1:5432/test) and each test gets its own schema (search_path in
the URL), dropped afterwards. Set but unreachable: the PostgreSQL tests FAIL, they do not skip.

``rng`` is a fresh random.Random per test, seeded from the OS; the seed is printed on failure
(set RESIDENCY_TEST_SEED to replay one).
"""
from __future__ import annotations

import os
import random
import uuid

import pytest

PG_ENV = "RESIDENCY_TEST_PG_URL"
BACKENDS = ["sqlite-file", "sqlite-memory", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def rng(request) -> random.Random:
    seed = int(os.environ.get("RESIDENCY_TEST_SEED") or random.SystemRandom().randrange(1 << 63))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed {seed} (RESIDENCY_TEST_SEED={seed} replays it)")
    return random.Random(seed)


@pytest.fixture(scope="session")
def pg_admin():
    """A SQLAlchemy engine on RESIDENCY_TEST_PG_URL; skips when unset, fails when unreachable."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set")
    from sqlalchemy import create_engine, text

    engine = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001
        engine.dispose()
        pytest.fail(f"{PG_ENV}={base} is set but PostgreSQL is unreachable: {e}", pytrace=False)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_schema_url(pg_admin):
    """Make an empty PostgreSQL schema; return a URL whose search_path points at it. Dropped after."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    schema = f"t_{uuid.uuid4().hex[:16]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(os.environ[PG_ENV]).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


@pytest.fixture(params=BACKENDS)
def ledger_url(request, tmp_path) -> str:
    """A URL naming a fresh, empty database on each backend."""
    if request.param == "sqlite-file":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    if request.param == "sqlite-memory":
        return "sqlite:///:memory:"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture
def ledger_store(ledger_url):
    """An initialized, empty LedgerStore on each backend."""
    from residency.ledger import LedgerStore

    store = LedgerStore.open(ledger_url, create=True)
    yield store
    store.close()
