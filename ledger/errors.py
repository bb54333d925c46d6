"""One exception tree for the ledger, and the one place database errors are translated.

Every error a caller can see is a ``LedgerError``; its message is one sentence a CLI prints as is
(no traceback). SQLAlchemy and DBAPI errors (sqlite3, psycopg) never leave the package: the store
wraps each operation in ``translating(...)`` which re-raises them as one of these, chained
(``raise LedgerUnavailable(...) from e``) so the cause is still there for a debugger.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import sqlalchemy.exc as sa_exc
from sqlalchemy.engine import URL, make_url


class LedgerError(Exception):
    """Root of every error the ledger raises."""


class LedgerUnavailable(LedgerError):
    """The database cannot be reached or opened (bad URL, server down, unwritable path)."""


class NotALedger(LedgerError):
    """The database is reachable but holds no ledger (empty, someone else's, or not a database)."""


class SchemaOutOfDate(LedgerError):
    """The ledger's schema revision is not the one this code was written against."""


class LedgerConflict(LedgerError):
    """The write contradicts what is stored (a retried triple with another payload, a non-empty import target)."""


class LedgerCorrupt(LedgerError):
    """Stored or imported data fails its own checks (hash chain, decode); the message names the seq or line."""


def masked(url: str | URL) -> str:
    """The URL with any password replaced by ``***``: safe for messages and logs."""
    try:
        u = make_url(url)
    except Exception:  # not even parseable: show it, it cannot hold a parsed password
        return str(url)
    if u.password is not None:
        return u.render_as_string(hide_password=True)
    if isinstance(url, str):
        return url
    if u.get_backend_name() == "sqlite" and not u.query:   # render_as_string would escape ':memory:'
        return f"{u.drivername}:///{u.database or ':memory:'}"
    return u.render_as_string(hide_password=False)


def init_hint(url: str | URL) -> str:
    return f"run `residency ledger init --db {masked(url)}` to create one"


# SQLite says these when the file is something other than an SQLite database.
_NOT_A_DATABASE = ("file is not a database", "file is encrypted or is not a database")
# Connection-level failures, whatever the backend words them as.
_UNREACHABLE = (
    "unable to open database file", "connection refused", "could not connect", "connection failed",
    "timeout expired", "could not translate host name", "name or service not known",
    "server closed the connection", "connection is closed", "the connection is lost",
    "database \"", "no password supplied", "authentication failed", "disk i/o error",
    "readonly database", "read-only",
)


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__


def translate(e: BaseException, url: str | URL, doing: str) -> LedgerError:
    """Map a SQLAlchemy/DBAPI exception to the ledger's tree (the caller raises it ``from e``)."""
    if isinstance(e, LedgerError):
        return e
    msg = _first_line(e)
    low = msg.lower()
    where = masked(url)
    if any(s in low for s in _NOT_A_DATABASE):
        return NotALedger(f"{where} is not a ledger: the file is not a database ({msg}); {init_hint(url)} at another path")
    if "no such table" in low or ("relation" in low and "does not exist" in low):
        return NotALedger(f"{where} is not a ledger (while {doing}: {msg}); {init_hint(url)}")
    if "append-only" in low:
        return LedgerError(f"{doing} on {where} was rejected: {msg}")
    if isinstance(e, (sa_exc.ArgumentError, sa_exc.NoSuchModuleError)):
        return LedgerUnavailable(f"cannot open the ledger at {where}: {msg}")
    is_operational = isinstance(e, sa_exc.OperationalError) or type(getattr(e, "orig", e)).__name__ == "OperationalError"
    if is_operational and any(s in low for s in _UNREACHABLE):
        return LedgerUnavailable(f"cannot reach the ledger database at {where}: {msg}")
    if isinstance(e, sa_exc.InterfaceError) or "connection" in low and is_operational:
        return LedgerUnavailable(f"lost the ledger database at {where} while {doing}: {msg}")
    if isinstance(e, sa_exc.IntegrityError) or type(getattr(e, "orig", e)).__name__ in ("IntegrityError", "UniqueViolation"):
        return LedgerConflict(f"{doing} on {where} conflicts with a stored row: {msg}")
    if is_operational and ("locked" in low or "busy" in low or "lock timeout" in low):
        return LedgerUnavailable(f"the ledger at {where} stayed locked by another writer while {doing}: {msg}")
    return LedgerError(f"{doing} on {where} failed: {msg}")


@contextlib.contextmanager
def translating(url: str | URL, doing: str, dbapi_error: type[BaseException] | tuple = ()) -> Iterator[None]:
    """Re-raise SQLAlchemy errors, and the given DBAPI error class(es), as ``LedgerError``s."""
    try:
        yield
    except LedgerError:
        raise
    except sa_exc.SQLAlchemyError as e:
        raise translate(e, url, doing) from e
    except dbapi_error as e:  # type: ignore[misc]
        raise translate(e, url, doing) from e
