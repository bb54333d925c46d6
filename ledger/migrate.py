"""Alembic, run programmatically: what `residency ledger init|current|upgrade|downgrade` call.

The Alembic environment and versions live in the ``migrations`` package (shipped as package data),
found through importlib, so this works from an installed wheel in any working directory. Each
function takes a URL or an Engine; given an Engine it migrates through that engine's own
connection (which is how ``sqlite:///:memory:`` gets a schema at all).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.resources
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from residency.ledger.backend import make_engine
from residency.ledger.errors import LedgerError, translating


def _location() -> Path:
    return Path(str(importlib.resources.files("residency.migrations")))


def config() -> Config:
    where = _location()
    cfg = Config(str(where / "alembic.ini"))
    cfg.set_main_option("script_location", str(where))
    return cfg


@functools.lru_cache(maxsize=1)
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    """The newest revision this code knows."""
    return _script().get_current_head()


def revisions() -> list[str]:
    """Every revision, oldest first."""
    return [s.revision for s in reversed(list(_script().walk_revisions()))]


@contextlib.contextmanager
def _engine(url_or_engine: str | Engine) -> Iterator[Engine]:
    if isinstance(url_or_engine, Engine):
        yield url_or_engine
        return
    engine = make_engine(url_or_engine)
    try:
        yield engine
    finally:
        engine.dispose()


def _run(url_or_engine: str | Engine, doing: str, fn, *args) -> None:
    with _engine(url_or_engine) as engine, translating(engine.url, doing):
        try:
            with engine.begin() as conn:
                cfg = config()
                cfg.attributes["connection"] = conn
                fn(cfg, *args)
        except CommandError as e:  # e.g. an unknown revision
            raise LedgerError(f"{doing} failed: {e}") from e


def upgrade(url: str | Engine, rev: str = "head") -> None:
    """Upgrade the ledger schema to ``rev`` (creating it on an empty database)."""
    _run(url, f"upgrading the ledger schema to {rev}", command.upgrade, rev)


def downgrade(url: str | Engine, rev: str) -> None:
    """Downgrade the ledger schema to ``rev`` (``"base"`` drops every ledger table)."""
    _run(url, f"downgrading the ledger schema to {rev}", command.downgrade, rev)


def current(url: str | Engine) -> str | None:
    """The schema revision stored in the database, or None when it has no ledger schema."""
    with _engine(url) as engine, translating(engine.url, "reading the ledger schema revision"):
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()


def is_known(rev: str) -> bool:
    try:
        return _script().get_revision(rev) is not None
    except Exception:
        return False


__all__ = ["upgrade", "downgrade", "current", "head", "revisions", "config"]
