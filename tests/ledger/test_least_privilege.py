"""PostgreSQL least privilege, as docs/operators.md sets it up: an owner role runs the migrations,
the server's role may only SELECT and INSERT events. The server's whole ledger path works under
it, and the ways around the append-only triggers (UPDATE, DELETE, TRUNCATE, disabling or dropping
a trigger, INSERT ... ON CONFLICT DO UPDATE) are refused to it by the database."""
from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import exc, text
from sqlalchemy.engine import make_url

from residency.events import Envelope
from residency.events.catalog import StateCheckpoint
from residency.ledger import GroupCommitWriter, LedgerStore, migrate
from tests.ledger.factories import random_items

pytestmark = pytest.mark.postgres


def grants(schema: str, role: str) -> list[str]:
    """The server role's privileges (the SQL docs/operators.md gives, with names filled in)."""
    return [
        f'GRANT USAGE ON SCHEMA "{schema}" TO {role}',
        f'GRANT SELECT, INSERT ON "{schema}".events TO {role}',
        f'GRANT SELECT, INSERT, DELETE ON "{schema}".snapshots TO {role}',
        f'GRANT SELECT ON "{schema}".alembic_version, "{schema}".residency_reclaimed, '
        f'"{schema}".residency_stranded TO {role}',
    ]


@pytest.fixture
def server_url(pg_admin, pg_schema_url):
    """(the owner's URL, a URL acting as a fresh role holding only the server's grants)."""
    migrate.upgrade(pg_schema_url)                      # as the owner
    u = make_url(pg_schema_url)
    schema = u.query["options"].split("=", 1)[1]
    role = f"residency_server_{uuid.uuid4().hex[:12]}"
    with pg_admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} NOLOGIN"))
        for sql in grants(schema, role):
            conn.execute(text(sql))
    # the test's login is a superuser: `role` makes the session act as the server role, with only its rights
    yield pg_schema_url, u.update_query_dict({"options": f"-csearch_path={schema} -crole={role}"}).render_as_string(
        hide_password=False)
    with pg_admin.connect() as conn:
        conn.execute(text(f"DROP OWNED BY {role}"))
        conn.execute(text(f"DROP ROLE {role}"))


def test_the_server_role_appends_verifies_and_snapshots(server_url, rng):
    _owner, url = server_url
    with LedgerStore.open(url, create=True) as store:       # what serve does: a no-op at head
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")).scalar() is False
        store.append(random_items(rng, rng.randint(5, 30)))
        writer = GroupCommitWriter(store)
        futures = [writer.submit(env, ev) for env, ev in random_items(rng, rng.randint(5, 30))]
        assert [f.result(10) for f in futures] == list(range(futures[0].result() , futures[-1].result() + 1))
        writer.close()
        through = store.last_seq()
        env = Envelope(producer="test", epoch=1, producer_seq=1, ts_ns=time.time_ns())
        [cp] = store.append([(env, StateCheckpoint(through_seq=through, state_hash="h"))])
        store.save_snapshot(through, rng.randbytes(64), "h", cp)
        assert store.load_snapshot(through).refused is None
        report = store.verify()
        assert report.ok and report.num_events == store.last_seq()
        with store.engine.connect() as conn:
            conn.execute(text("SELECT count(*) FROM residency_reclaimed")).scalar_one()


@pytest.mark.parametrize("sql", [
    "UPDATE events SET producer = 'mallory' WHERE seq = 1",
    "DELETE FROM events WHERE seq = 1",
    "TRUNCATE events",
    "ALTER TABLE events DISABLE TRIGGER USER",
    "DROP TRIGGER events_no_update_delete ON events",
    "INSERT INTO events SELECT * FROM events WHERE seq = 1 ON CONFLICT (seq) DO UPDATE SET producer = 'mallory'",
    "DROP TABLE events",
])
def test_the_server_role_cannot_go_around_the_triggers(server_url, rng, sql):
    _owner, url = server_url
    with LedgerStore.open(url) as store:
        store.append(random_items(rng, rng.randint(3, 10)))
        before = list(store.read_raw())
        with pytest.raises(exc.DBAPIError, match="permission denied|must be owner"):
            with store.engine.begin() as conn:
                conn.execute(text(sql))
        assert list(store.read_raw()) == before and store.verify().ok
