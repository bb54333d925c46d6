"""Alembic environment for the ledger schema.

Runs on the connection ``ledger.migrate`` hands in (``config.attributes["connection"]``), so
``sqlite:///:memory:`` and an already-open store migrate the database they actually use. From the
alembic CLI, give the URL with ``-x url=...``. SQLite runs in batch mode (ALTER via table copy).
"""
from __future__ import annotations

from alembic import context

from residency.ledger.schema import metadata

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from residency.ledger.backend import make_engine

    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database URL: pass -x url=sqlite:///PATH (or use ledger.migrate)")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: the ledger's triggers differ per backend")
run_migrations_online()
