"""Engines and the few things SQLite and PostgreSQL do differently.

Hot paths (append, read, verify, import) run on the raw DBAPI connection that SQLAlchemy pools
(``engine.raw_connection()``) with pre-built tuples: per-row SQLAlchemy objects cost more than
the whole insert. Everything else (schema checks, snapshots, small queries, Alembic) uses Core.
Appends (and imports) run on one connection each store keeps for writing (``Raw.writing``), not
on a pool checkout per transaction.

SQLite: WAL, ``busy_timeout``, a larger page cache and mmap are set on every new connection.
The sqlite3 module's implicit transactions are turned off (``isolation_level=None``) and
SQLAlchemy emits ``BEGIN`` itself, so Core transactions and our ``BEGIN IMMEDIATE`` both mean
what they say. ``sqlite:///:memory:`` uses one shared connection (StaticPool); the store then
serializes every use of it with a lock.

Durability (``durability=`` on ``LedgerStore.append`` and ``GroupCommitWriter``):

    level    SQLite (WAL)                                   PostgreSQL
    full     PRAGMA synchronous=FULL: the WAL is fsynced    synchronous_commit=on: COMMIT returns
             at every commit; a commit survives power loss  once the WAL is flushed to disk
    normal   PRAGMA synchronous=NORMAL: no fsync at commit  synchronous_commit=off: COMMIT returns
             (only at checkpoints); a commit survives a     before the flush; a server crash can lose
             process crash, not an OS crash/power loss      the last ~3 x wal_writer_delay of commits
Neither level can corrupt the ledger or break the chain: a lost commit is lost whole.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.pool import StaticPool

from residency.ledger.append import Tail
from residency.ledger.schema import EVENT_COLUMNS
from residency.ledger.errors import LedgerError, LedgerUnavailable, NotALedger, init_hint, masked, translating

DURABILITY = ("normal", "full")
PG_WRITE_LOCK = "SELECT pg_advisory_xact_lock('events'::regclass::oid::bigint)"     # see Dialect.begin_write
_SQLITE_PRAGMAS = (
    "PRAGMA busy_timeout = 30000",
    "PRAGMA foreign_keys = ON",
    "PRAGMA cache_size = -65536",      # 64 MiB page cache
    "PRAGMA temp_store = MEMORY",
    "PRAGMA reverse_unordered_selects = OFF",    # the default; replay's packed runs rely on it
)


def is_sqlite_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and (
        url.database in (None, "", ":memory:") or "mode=memory" in str(url))


def parse_url(url: str | URL) -> URL:
    try:
        u = make_url(url)
    except Exception as e:
        raise LedgerUnavailable(f"{masked(url)} is not a database URL (expected sqlite:///PATH or postgresql+psycopg://...)") from e
    if u.drivername == "postgresql":       # plain postgresql:// means psycopg (3) here, not psycopg2
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise LedgerUnavailable(f"{masked(u)}: the ledger supports SQLite and PostgreSQL only")
    return u


def sqlite_file_missing(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and not is_sqlite_memory(url) and not os.path.exists(url.database)


def _create_private(path: str) -> None:
    """A new ledger file is made 0600 before SQLite opens it (its -wal and -shm files take the same
    mode): the ledger names sessions and workers. A file that already exists keeps its mode."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass
    except OSError:
        pass      # SQLite reports why it cannot open this path, with the ledger's own error


def make_engine(url: str | URL, *, must_exist: bool = False) -> Engine:
    """An engine for ``url`` with the ledger's connection settings.

    ``must_exist``: refuse (NotALedger) an SQLite path that does not exist rather than create an
    empty file there.
    """
    u = parse_url(url)
    if u.get_backend_name() == "sqlite":
        if must_exist and sqlite_file_missing(u):
            raise NotALedger(f"there is no ledger at {masked(u)} (no such file); {init_hint(u)}")
        return _sqlite_engine(u)
    connect_args = {} if "connect_timeout" in u.query else {"connect_timeout": 5}
    with translating(u, "opening the engine"):
        return create_engine(u, connect_args=connect_args, pool_size=8, max_overflow=8)


def _sqlite_engine(u: URL) -> Engine:
    memory = is_sqlite_memory(u)
    if not memory:
        _create_private(u.database)
    with translating(u, "opening the engine"):
        if memory:
            engine = create_engine(u, poolclass=StaticPool, connect_args={"check_same_thread": False})
        else:
            engine = create_engine(u, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=8)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised by every test
        dbapi_conn.isolation_level = None          # we issue BEGIN ourselves (see module doc)
        cur = dbapi_conn.cursor()
        try:
            if not memory:
                cur.execute("PRAGMA journal_mode = WAL")
                cur.execute("PRAGMA mmap_size = 268435456")
            for pragma in _SQLITE_PRAGMAS:
                cur.execute(pragma)
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # pragma: no cover
        # execution_options(ledger_write=True): take the write lock up front (see Dialect.begin_write)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("ledger_write") else "BEGIN")

    return engine


class LazyBegin:
    """The kept PostgreSQL cursor in a writing transaction whose BEGIN (with ``SET LOCAL`` and the
    write lock) is not sent yet. Any statement sends it first, in one round trip, except a short
    insert that commits (``Dialect.insert_events``), which sends it in its own pipeline: BEGIN,
    lock, rows and COMMIT in one round trip. Nothing sent, nothing to commit or roll back."""

    __slots__ = ("cur", "pending")

    def __init__(self, cur, statements: list[str]):
        self.cur, self.pending = cur, statements

    def take_begin(self) -> list[str] | None:
        pending, self.pending = self.pending, None
        return pending

    def begin_now(self) -> None:
        if self.pending is not None:
            self.cur.execute("; ".join(self.take_begin()))

    @property
    def connection(self):
        return self.cur.connection

    def execute(self, *args, **kw):
        self.begin_now()
        return self.cur.execute(*args, **kw)

    def executemany(self, *args, **kw):
        self.begin_now()
        return self.cur.executemany(*args, **kw)

    def copy(self, *args, **kw):
        self.begin_now()
        return self.cur.copy(*args, **kw)

    def fetchone(self):
        return self.cur.fetchone()

    def fetchall(self):
        return self.cur.fetchall()

    def __getattr__(self, name):          # anything else: the transaction must be open first
        self.begin_now()
        return getattr(self.cur, name)


class Dialect:
    """SQL text for the hot paths, per backend."""

    def __init__(self, engine: Engine):
        self.name = engine.dialect.name
        self.sqlite = self.name == "sqlite"
        self.dbapi_error = engine.dialect.loaded_dbapi.Error
        self.integrity_error = engine.dialect.loaded_dbapi.IntegrityError   # a key or constraint said no
        self.p = "?" if self.sqlite else "%s"
        cols = ", ".join(EVENT_COLUMNS)
        self._insert_sql = f"INSERT INTO events ({cols}) VALUES ({self.marks(len(EVENT_COLUMNS))})"
        self._copy_sql = f"COPY events ({cols}) FROM STDIN"

    def marks(self, n: int) -> str:
        return ", ".join([self.p] * n)

    def insert_events(self, cur, rows: list[tuple], commit: bool = False) -> None:
        """Insert pre-built events rows (EVENT_COLUMNS order) inside the caller's transaction.

        SQLite: executemany. PostgreSQL: COPY, which is ~2.5x executemany (even pipelined) here.
        ``commit`` (the caller commits next): PostgreSQL sends a few rows and COMMIT in one
        pipeline, one round trip; a key that says no is raised here, the transaction then
        failed, not committed (the caller rolls back). Its ``commit()`` after is a no-op.
        """
        if self.sqlite:
            cur.executemany(self._insert_sql, rows)
            return
        if len(rows) < 8:                       # COPY's extra round trips cost more than they save here
            if commit and cur.connection.autocommit:       # the kept connection (``keep``)
                begin = cur.take_begin() if isinstance(cur, LazyBegin) else None
                raw = cur.cur if isinstance(cur, LazyBegin) else cur
                with raw.connection.pipeline():     # BEGIN and the lock too, when not sent yet
                    for statement in begin or ():
                        raw.execute(statement)
                    raw.executemany(self._insert_sql, rows)
                    raw.execute("COMMIT")
            else:
                cur.executemany(self._insert_sql, rows)
            return
        with cur.copy(self._copy_sql) as copy:
            write_row = copy.write_row
            for row in rows:
                write_row(row)

    def fetchall(self, cur, sql: str, params: tuple) -> list[tuple]:
        """Run a SELECT; PostgreSQL in binary (no hex round trip for bytea, ~25% faster)."""
        if self.sqlite:
            cur.execute(sql, params)
        else:
            cur.execute(sql, params, binary=True)
        return cur.fetchall()

    def set_durability(self, cur, durability: str) -> None:
        """SQLite: ``PRAGMA synchronous``, a setting of the connection (not of a transaction), so the
        kept writing connection sets it once per level (``Raw.writing``). PostgreSQL: nothing here;
        ``begin_write`` sets it for each transaction, in the round trip that takes the lock."""
        if self.sqlite:
            cur.execute("PRAGMA synchronous = " + ("FULL" if durability == "full" else "NORMAL"))

    def write_cursor(self, cur, durability: str):
        """``cur`` inside a new writing transaction (``begin_write``). PostgreSQL on the kept
        connection: a ``LazyBegin`` that sends BEGIN with the first statement, or, when that is
        a short insert that commits, in the insert's pipeline: one round trip for an append whose
        tail the writer remembers (``ledger.append.write``)."""
        if self.sqlite or not cur.connection.autocommit:
            self.begin_write(cur, durability)
            return cur
        return LazyBegin(cur, self._begin_statements(durability))

    def _begin_statements(self, durability: str) -> list[str]:
        return ["BEGIN", "SET LOCAL synchronous_commit TO " + ("on" if durability == "full" else "off"),
                PG_WRITE_LOCK]

    def begin_write(self, cur, durability: str) -> None:
        """Start the writing transaction and take the ledger's write lock.

        NOTE: this lock is what makes seq gapless *in commit order*. Seq = last_seq + 1 is computed
        inside the transaction that holds it, so seq N+1 can never commit before seq N and a reader
        tailing by seq never skips one. A bare sequence/identity column hands numbers out at insert
        time: a reader can see 5 committed before 4 and skip 4 forever (Marten shipped that bug).
        SQLite: BEGIN IMMEDIATE takes the database's single write lock up front (``durability`` is
        the connection's, see ``set_durability``).
        PostgreSQL: a transaction-scoped advisory lock keyed by the events table's oid (so one per
        ledger schema), taken by every writer of ours; reads take nothing. Not ``LOCK TABLE ... IN
        EXCLUSIVE MODE``: that needs UPDATE, DELETE or TRUNCATE on the table, which a
        least-privilege server role (INSERT and SELECT only, docs/operators.md) does not have. A
        writer that is not ours and takes no lock is still refused by the keys (``StaleTail``).
        """
        if self.sqlite:
            cur.execute("BEGIN IMMEDIATE")
        else:   # one round trip: the kept connection is in autocommit mode (``keep``), so BEGIN is ours
            cur.execute("; ".join(self._begin_statements(durability)))

    def keep(self, conn) -> None:
        """A raw connection becomes the one kept for writing. PostgreSQL: autocommit, so that
        ``begin_write`` sends BEGIN with the lock in one round trip (psycopg would otherwise send
        its own BEGIN first, a round trip more on every append); ``commit()``/``rollback()`` still
        end the transaction BEGIN opened. ``unkeep`` undoes it before the pool has it back."""
        if not self.sqlite:
            conn.driver_connection.autocommit = True

    def unkeep(self, conn) -> None:
        if not self.sqlite:
            conn.driver_connection.autocommit = False


class Raw:
    """Checks out raw DBAPI connections; serializes them when SQLite lives in memory (one connection)."""

    def __init__(self, engine: Engine, url: URL):
        self.engine = engine
        self.url = url
        self.dialect = Dialect(engine)
        self.memory = is_sqlite_memory(url)
        # Appends from threads of one process queue here (rather than spin on SQLite's busy handler
        # or wait on PostgreSQL's table lock): they share the one connection kept for writing.
        self.write_lock = threading.Lock()
        self._mem_lock = threading.RLock() if self.memory else contextlib.nullcontext()
        self.closed = False
        # under write_lock: the connection kept for writing, its cursor, the durability it is set to
        self._kept: tuple | None = None
        self._kept_durability: str | None = None
        self.tail = Tail()

    def close(self) -> None:
        """Dispose of the engine. Waits for an append in progress, and for an in-flight statement on
        a shared in-memory connection: closing it under a running query would pull the database out
        from under it."""
        with self.write_lock, self._mem_lock:
            if not self.closed:
                self.closed = True
                self._drop_kept(invalidate=False)
                self.engine.dispose()

    def check_open(self) -> None:
        if self.closed:
            raise LedgerError(f"the ledger store for {masked(self.url)} is closed")

    @contextlib.contextmanager
    def core(self, doing: str, write: bool = False) -> Iterator[Connection]:
        """A Core connection; ``write=True``: one transaction, committed on exit (SQLite: BEGIN IMMEDIATE)."""
        with (self.write_lock if write else contextlib.nullcontext()), self._mem_lock, \
                translating(self.url, doing, self.dialect.dbapi_error):
            self.check_open()          # under the lock: close() may have run while we waited
            with self.engine.connect() as conn:
                if not write:
                    yield conn
                    return
                conn = conn.execution_options(ledger_write=True)
                with conn.begin():
                    yield conn

    @contextlib.contextmanager
    def cursor(self, doing: str) -> Iterator[tuple]:
        """(dbapi_connection, cursor); rolls back whatever is uncommitted on the way out."""
        with self._mem_lock, translating(self.url, doing, self.dialect.dbapi_error):
            self.check_open()          # under the lock: close() may have run while we waited
            conn = self.engine.raw_connection()
            try:
                cur = conn.cursor()
                try:
                    yield conn, cur
                finally:
                    cur.close()
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.rollback()
                raise
            finally:
                conn.close()

    @contextlib.contextmanager
    def writing(self, doing: str, durability: str) -> Iterator[tuple]:
        """(dbapi connection, cursor) inside a writing transaction (``Dialect.begin_write``) on the
        connection this store keeps for its writes; the caller holds ``write_lock`` and commits.

        The connection is opened on first use and kept: no pool checkout and return (a rollback)
        around every append, and SQLite's ``PRAGMA synchronous`` is issued only when the level
        changes. Whatever is uncommitted on the way out is rolled back and ``tail`` is forgotten.
        A connection that failed (anything but a key or constraint saying no) is dropped and the
        next call opens another; SQLite in memory keeps its one connection (it is the database).
        """
        with self._mem_lock, translating(self.url, doing, self.dialect.dbapi_error):
            self.check_open()          # under the lock: close() may have run while we waited
            d = self.dialect
            if self._kept is None:
                conn = self.engine.raw_connection()
                d.keep(conn)
                self._kept = (conn, conn.cursor())
                self._kept_durability = None
            conn, cur = self._kept
            try:
                if self._kept_durability != durability:
                    d.set_durability(cur, durability)
                    self._kept_durability = durability
                yield conn, d.write_cursor(cur, durability)
            except BaseException as e:
                self.tail.forget()
                with contextlib.suppress(Exception):
                    conn.rollback()
                if isinstance(e, d.dbapi_error) and not isinstance(e, d.integrity_error):
                    self._drop_kept(invalidate=not self.memory)
                raise

    def _drop_kept(self, invalidate: bool) -> None:
        """Let go of the kept writing connection; ``invalidate``: it is broken, close it for good."""
        kept, self._kept, self._kept_durability = self._kept, None, None
        if kept is None:
            return
        conn, cur = kept
        with contextlib.suppress(Exception):
            cur.close()
        if not invalidate:
            try:
                self.dialect.unkeep(conn)      # as the pool handed it out
            except Exception:  # noqa: BLE001 - then it does not go back to the pool
                invalidate = True
        with contextlib.suppress(Exception):
            if invalidate:
                conn.invalidate()
            conn.close()
