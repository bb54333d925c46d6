"""Opening: every way a URL can fail to be a usable ledger gets its own named error."""
from __future__ import annotations

import socket

import pytest
from sqlalchemy import text

from residency.ledger import LedgerError, LedgerStore, LedgerUnavailable, NotALedger, SchemaOutOfDate, migrate


def _one_sentence(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 400
    return msg


def test_an_empty_database_is_not_a_ledger_and_the_message_says_how_to_init(ledger_url):
    if ledger_url.startswith("sqlite:///") and ledger_url != "sqlite:///:memory:":
        open(ledger_url[len("sqlite:///"):], "wb").close()     # an existing, empty file
    with pytest.raises(NotALedger) as info:
        LedgerStore.open(ledger_url)
    assert "has no ledger schema" in _one_sentence(info.value)
    assert "residency ledger init" in str(info.value)


def test_a_missing_sqlite_file_is_not_a_ledger_and_is_not_created(tmp_path):
    path = tmp_path / "nope.db"
    with pytest.raises(NotALedger, match="no such file"):
        LedgerStore.open(f"sqlite:///{path}")
    assert not path.exists()


def test_a_file_of_random_bytes_is_not_a_ledger(tmp_path, rng):
    path = tmp_path / "noise.db"
    path.write_bytes(rng.randbytes(rng.randint(4096, 65536)))
    with pytest.raises(NotALedger, match="not a database") as info:
        LedgerStore.open(f"sqlite:///{path}")
    _one_sentence(info.value)
    with pytest.raises(NotALedger):
        LedgerStore.open(f"sqlite:///{path}", create=True)
    with pytest.raises(NotALedger):
        migrate.current(f"sqlite:///{path}")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_an_unreachable_server_is_unavailable_and_the_password_is_masked(rng):
    secret = rng.randbytes(8).hex()
    url = f"postgresql+psycopg://auditor:{secret}@127.0.0.1:{_closed_port()}/ledger"
    with pytest.raises(LedgerUnavailable) as info:
        LedgerStore.open(url)
    msg = _one_sentence(info.value)
    assert secret not in msg and "auditor:***@127.0.0.1" in msg


@pytest.mark.parametrize("url, words", [
    ("sqlite:////no/such/dir/ledger.db", "cannot reach"),
    ("not a url at all", "is not a database URL"),
    ("mysql://root@127.0.0.1/x", "SQLite and PostgreSQL only"),
])
def test_urls_that_cannot_be_opened_are_unavailable(url, words):
    with pytest.raises(LedgerUnavailable, match=words) as info:
        LedgerStore.open(url, create=True)
    _one_sentence(info.value)


def test_an_old_schema_is_out_of_date_and_says_how_to_upgrade(ledger_url):
    if ledger_url == "sqlite:///:memory:":
        pytest.skip("needs the database to outlive one engine")
    migrate.upgrade(ledger_url, migrate.revisions()[0])
    with pytest.raises(SchemaOutOfDate, match=f"needs {migrate.head()}; run `residency ledger upgrade") as info:
        LedgerStore.open(ledger_url)
    _one_sentence(info.value)
    LedgerStore.open(ledger_url, create=True).close()      # init upgrades it


def test_a_schema_from_the_future_is_out_of_date_too(ledger_url):
    if ledger_url == "sqlite:///:memory:":
        pytest.skip("needs the database to outlive one engine")
    LedgerStore.open(ledger_url, create=True).close()
    from residency.ledger.backend import make_engine
    engine = make_engine(ledger_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
    engine.dispose()
    with pytest.raises(SchemaOutOfDate, match="revision f00d, which this code does not know"):
        LedgerStore.open(ledger_url)


def test_a_closed_store_says_it_is_closed(ledger_store):
    ledger_store.close()
    ledger_store.close()               # closing twice is fine
    with pytest.raises(LedgerError, match="is closed"):
        ledger_store.last_seq()
    with pytest.raises(LedgerError, match="is closed"):
        ledger_store.append([])
    with pytest.raises(LedgerError, match="is closed"):
        ledger_store.verify()
