"""LedgerStore: the append-only event store over SQLite or PostgreSQL.

    store = LedgerStore.open(url)              # NotALedger / SchemaOutOfDate / LedgerUnavailable
    seqs = store.append([(envelope, event), ...])
    for rec in store.read(from_seq=1): ...
    report = store.verify()

One writer at a time assigns seqs (see ``Dialect.begin_write`` for why it is a lock, not a
sequence), so seqs are gapless and in commit order; an append is one transaction. Reads stream in
batches of seq ranges (``seq BETWEEN a AND a + n - 1``), one short statement each: no cursor or lock is
held between batches, and since rows never change, batches read at different times still form one
consistent prefix of the ledger.
"""
from __future__ import annotations

from typing import IO, Callable, Iterator, Sequence

from sqlalchemy import func, select
from sqlalchemy.engine import URL

from residency.events import DecodeError, Envelope, Recorded, decode_event
from residency.events.catalog import EVENT_TYPES, Event, MoveAcked
from residency.ledger import append as _append
from residency.ledger.anchor import Anchor, check as check_anchors
from residency.ledger import snapshots
from residency.ledger.backend import DURABILITY, Raw, make_engine, parse_url
from residency.ledger.errors import LedgerCorrupt, NotALedger, SchemaOutOfDate, init_hint, masked
from residency.ledger.prefetch import prefetched
from residency.ledger.schema import EVENT_COLUMNS, RAW_COLUMNS, PackedRun, PayloadRun, RawRow, Snapshot, events
from residency.ledger.verify import Progress, VerifyReport, verify_batches
from residency.ledger.verify_parallel import default_workers, verify_parallel

READ_BATCH = 10_000


class LedgerStore:
    """An open ledger. Thread-safe: every method may be called from any thread."""

    def __init__(self, raw: Raw):  # use LedgerStore.open
        self._raw = raw
        self._d = raw.dialect
        self._read_sql = (f"SELECT {', '.join(RAW_COLUMNS)} FROM events "
                          f"WHERE seq >= {self._d.p} AND seq <= {self._d.p} ORDER BY seq")
        self._audited_sql = (f"SELECT {', '.join(EVENT_COLUMNS)} FROM events "
                             f"WHERE seq >= {self._d.p} AND seq <= {self._d.p} ORDER BY seq")
        self._run_sql = (f"SELECT type, schema_version, payload FROM events "
                         f"WHERE seq >= {self._d.p} AND seq <= {self._d.p} ORDER BY seq")
        self._ts_sql = f"SELECT ts_ns FROM events WHERE seq = {self._d.p}"
        self._packed_sql = _packed_sql(self._d.p) if self._d.sqlite else None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, url: str | URL, create: bool = False) -> "LedgerStore":
        """Open the ledger at ``url``; ``create=True`` first upgrades the schema to head (init).

        Raises NotALedger (no ledger schema, or not a database), SchemaOutOfDate (older or unknown
        revision), LedgerUnavailable (cannot connect or open).
        """
        from residency.ledger import migrate  # alembic: imported only by what opens or migrates a ledger

        u = parse_url(url)
        engine = make_engine(u, must_exist=not create)
        try:
            if create:
                migrate.upgrade(engine)
            _check_schema(engine, u)
        except BaseException:
            engine.dispose()
            raise
        return cls(Raw(engine, u))

    def close(self) -> None:
        """Release the connections; idempotent. Later calls raise LedgerError."""
        self._raw.close()

    def __enter__(self) -> "LedgerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def engine(self):
        """The SQLAlchemy engine, for plain-SQL audit queries (the events table rejects writes)."""
        return self._raw.engine

    @property
    def url(self) -> str:
        """The URL with the password masked."""
        return masked(self._raw.url)

    @property
    def backend(self) -> str:
        return self._d.name

    def __repr__(self) -> str:
        return f"LedgerStore({self.url!r})"

    # ------------------------------------------------------------------ writing
    def append(self, items: Sequence[tuple[Envelope, Event]], *, durability: str = "full") -> list[int]:
        """Append ``items`` in ONE transaction; returns their seqs, in item order.

        Idempotent per (producer, epoch, producer_seq): a stored triple returns its stored seq and
        writes nothing. Raises LedgerConflict (a retried triple with another payload; nothing of the
        batch is written), LedgerUnavailable. ``durability``: "full" or "normal", see ledger.backend.
        """
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        self._raw.check_open()
        if not items:
            return []
        prepared = _append.prepare(items)
        raw = self._raw
        with raw.write_lock:
            tail = raw.tail
            try:
                return self._write(prepared, durability, tail)
            except _append.StaleTail:        # another writer appended: write again, reading everything
                tail.forget()
                return self._write(prepared, durability, tail)

    def warm_writer(self, durability: str = "normal", payload_bytes: int = 0) -> bool:
        """Open a write transaction on the kept writing connection, read the tail and (with
        ``payload_bytes``) insert a row of about that size after it, then roll back: nothing is
        written, nothing remembered changes, and the append path's code, its statement and the
        pages an append touches (the table's and its indexes' right edges, new overflow pages)
        are back in the CPU's caches for the append that follows soon (after an idle wait, a
        big ack's append is several times slower than the same append back to back).
        False (nothing done) when another thread is writing."""
        raw = self._raw
        if not raw.write_lock.acquire(blocking=False):
            return False
        try:
            with raw.writing("warming the writer", durability) as (conn, cur):
                last_seq, prev = _append.read_tail(cur)
                if payload_bytes:
                    env = Envelope(producer="warm-up", epoch=0, producer_seq=0, ts_ns=0)
                    ack = MoveAcked(move_id="warm-up", worker=0, bytes_moved=0, bytes_freed_src=0, checksum_ok=True,
                                    started_ns=0, finished_ns=0, checksums=b"\x5a" * payload_bytes)
                    self._d.insert_events(cur, _append.chain(_append.prepare([(env, ack)]), last_seq, prev))
                conn.rollback()
        finally:
            raw.write_lock.release()
        return True

    def _write(self, prepared: list, durability: str, tail: _append.Tail) -> list[int]:
        """One transaction on the kept writing connection; the caller holds the write lock."""
        with self._raw.writing("appending events", durability) as (conn, cur):
            seqs = _append.write(cur, self._d, prepared, tail, commit=True)
            conn.commit()          # (a no-op where the insert committed: Dialect.insert_events)
        tail.committed()
        return seqs

    # ------------------------------------------------------------------ reading
    def last_seq(self) -> int:
        """The last seq (0 when empty)."""
        with self._raw.core("reading the last seq") as conn:
            return conn.execute(select(func.coalesce(func.max(events.c.seq), 0))).scalar_one()

    def seq_at_time(self, ts_ns: int) -> int:
        """The last seq whose ``ts_ns <= ts_ns`` (0 when none): replay to this seq to see that instant."""
        with self._raw.core("finding the seq at a time") as conn:
            q = select(func.coalesce(func.max(events.c.seq), 0)).where(events.c.ts_ns <= ts_ns)
            return conn.execute(q).scalar_one()

    def raw_batches(self, from_seq: int = 1, to_seq: int | None = None,
                    batch: int | None = None, *, audited: bool = False) -> Iterator[list[tuple]]:
        """Undecoded rows (RawRow-shaped plain tuples) in seq order, ``batch`` at a time;
        ``audited``: each row goes on with the six audit columns (all of ``EVENT_COLUMNS``).

        When the range spans several batches, the next one is fetched on a thread while the
        caller works on this one (``prefetched``).
        """
        batch = batch or READ_BATCH
        if to_seq is None:
            to_seq = self.last_seq()
        start = max(1, from_seq)
        batches = self._fetch_batches(start, to_seq, batch, self._audited_sql if audited else self._read_sql)
        return prefetched(batches) if to_seq - start >= batch else batches

    def _fetch_batches(self, start: int, to_seq: int, batch: int, sql: str | None = None) -> Iterator[list[tuple]]:
        # NOTE: each query asks for a closed range of at most ``batch`` seqs, not "seq >= a ORDER BY
        # seq LIMIT n": on a freshly loaded PostgreSQL table (no statistics yet) the planner answers
        # the open form by sorting everything after a, once per batch. A gap (only in a damaged
        # ledger) is skipped by asking where the next stored seq is.
        while start <= to_seq:
            hi = min(to_seq, start + batch - 1)
            with self._raw.cursor("reading events") as (_conn, cur):
                rows = self._d.fetchall(cur, sql or self._read_sql, (start, hi))
            if rows:
                yield rows
                start = hi + 1
            else:
                nxt = self.next_seq(start)
                if nxt is None:
                    return
                start = nxt

    def payload_runs(self, from_seq: int = 1, to_seq: int | None = None,
                     batch: int | None = None) -> Iterator[PayloadRun | list[tuple]]:
        """What a fold needs, ``batch`` rows at a time, prefetched like ``raw_batches``.

        A gapless range comes as a PayloadRun ((type, schema version, payload) per row, the seqs
        implied): replay's fast path, a third of the columns ``raw_batches`` reads. A range
        with a gap (only in a damaged ledger) comes as RawRow-shaped tuples, as ``raw_batches``
        gives it, so the caller sees the actual seqs.
        """
        batch = batch or READ_BATCH
        if to_seq is None:
            to_seq = self.last_seq()
        start = max(1, from_seq)
        runs = self._fetch_runs(start, to_seq, batch)
        return prefetched(runs) if to_seq - start >= batch else runs

    def _fetch_runs(self, start: int, to_seq: int, batch: int) -> Iterator[PayloadRun | list[tuple]]:
        while start <= to_seq:
            hi = min(to_seq, start + batch - 1)
            with self._raw.cursor("reading events") as (_conn, cur):
                rows = self._d.fetchall(cur, self._run_sql, (start, hi))
                last_ts = self._d.fetchall(cur, self._ts_sql, (hi,)) if len(rows) == hi - start + 1 else None
            if last_ts:
                # seq is the primary key: hi - start + 1 rows in [start, hi] means none is missing
                yield PayloadRun(start, last_ts[0][0], rows)
            else:
                yield from self._fetch_batches(start, hi, batch)
            start = hi + 1

    def packed_runs(self, from_seq: int = 1, to_seq: int | None = None,
                    batch: int | None = None) -> Iterator[PackedRun | PayloadRun | list[tuple]]:
        """Like ``payload_runs``, but on SQLite a gapless run whose rows all carry their type's
        current schema version comes packed by the database (``PackedRun``): its payloads
        concatenated into one bytes, its rows' types and payload lengths into two strings.

        Replay's fast path: SQLite walks and concatenates the rows in one statement, which
        runs without the GIL on the prefetch thread, and hands over three Python objects per
        ``batch`` rows instead of a tuple and three objects per row
        (``events.codec.decode_packed`` decodes them in one call). A run with a row of an
        older schema comes as a PayloadRun (to upcast), a range with a gap as RawRow-shaped
        tuples, as ``payload_runs`` gives them.

        PostgreSQL gives every run as ``payload_runs`` does: its server builds such aggregates
        slower than it sends the rows (ORDER BY in each aggregate, a function call per row and
        aggregate), and the rows come parsed by psycopg's C code (a replay reads rows faster than
        packed runs there; bench/replay.py measures both).
        """
        if not self._d.sqlite:
            return self.payload_runs(from_seq, to_seq, batch)
        batch = batch or READ_BATCH
        if to_seq is None:
            to_seq = self.last_seq()
        start = max(1, from_seq)
        runs = self._fetch_packed(start, to_seq, batch)
        return prefetched(runs) if to_seq - start >= batch else runs

    def _fetch_packed(self, start: int, to_seq: int, batch: int) -> Iterator[PackedRun | PayloadRun | list[tuple]]:
        while start <= to_seq:
            hi = min(to_seq, start + batch - 1)
            with self._raw.cursor("reading events") as (conn, cur):
                try:
                    num, num_older, payloads, types, lengths, last_ts = \
                        self._d.fetchall(cur, self._packed_sql, (hi, start, hi))[0]
                except self._d.dbapi_error as e:
                    if getattr(e, "sqlite_errorname", None) != "SQLITE_TOOBIG":    # over SQLITE_MAX_LENGTH
                        raise
                    conn.rollback()
                    num = num_older = None      # the run's payloads exceed one value of the database
            if num == hi - start + 1 and num_older == 0:
                # seq is the primary key: hi - start + 1 rows in [start, hi] means none is missing
                yield PackedRun(start, last_ts, num, payloads, types, lengths)
            else:
                yield from self._fetch_runs(start, hi, batch)
            start = hi + 1

    def read_raw(self, from_seq: int = 1, to_seq: int | None = None) -> Iterator[RawRow]:
        """Undecoded rows from ``from_seq`` through ``to_seq`` (default: the last seq now)."""
        make = RawRow._make
        for rows in self.raw_batches(from_seq, to_seq):
            for r in rows:
                yield make(r)

    def read(self, from_seq: int = 1, to_seq: int | None = None) -> Iterator[Recorded]:
        """Decoded events (envelope with seq, event, row_hash); older schemas are upcast.

        Raises LedgerCorrupt naming the seq of a payload that does not decode.
        """
        for rows in self.raw_batches(from_seq, to_seq):
            for r in rows:
                try:
                    event = decode_event(r[9], r[5], r[6])
                except DecodeError as e:
                    raise LedgerCorrupt(f"seq {r[0]} in {self.url}: {e}") from e
                env = Envelope(producer=r[2], epoch=r[3], producer_seq=r[4], ts_ns=r[1],
                               correlation_id=r[7], causation=r[8], seq=r[0])
                yield Recorded(env, event, bytes(r[10]))

    def next_seq(self, seq: int) -> int | None:
        """The first stored seq >= ``seq`` (None past the end): for wording a gap."""
        with self._raw.core("reading a seq") as conn:
            return conn.execute(select(func.min(events.c.seq)).where(events.c.seq >= seq)).scalar_one()

    def peek_raw(self, seq: int) -> tuple | None:
        rows = next(self.raw_batches(seq, seq, 1), [])
        return rows[0] if rows else None

    # ------------------------------------------------------------------ snapshots
    def save_snapshot(self, through_seq: int, state_bytes: bytes, state_hash: str, checkpoint_seq: int) -> None:
        """Store the folded state through ``through_seq`` (replaces one already there); the
        StateCheckpoint event at ``checkpoint_seq`` must record that seq and hash (LedgerConflict
        otherwise: see ledger.snapshots)."""
        with self._raw.core("saving a snapshot", write=True) as conn:
            snapshots.save(conn, through_seq, state_bytes, state_hash, checkpoint_seq)

    def load_snapshot(self, at_or_before_seq: int) -> Snapshot | None:
        """The newest snapshot with ``through_seq <= at_or_before_seq``, or None. Check
        ``refused`` before using it: set when the hash chain does not vouch for it."""
        with self._raw.core("loading a snapshot") as conn:
            return snapshots.load(conn, at_or_before_seq)

    # ------------------------------------------------------------------ integrity and portability
    def head(self) -> tuple[int, bytes]:
        """(last seq, its row_hash) as this store's writer last committed them (what it chained
        itself, not what the database says now), or as read when it has not written yet."""
        raw = self._raw
        with raw.write_lock:
            if raw.tail.seq is not None:
                return raw.tail.seq, raw.tail.hash
        with raw.cursor("reading the head") as (_conn, cur):
            return _append.read_tail(cur)

    def verify(self, progress: Progress | None = None, workers: int | None = None,
               anchors: "list[Anchor] | None" = None) -> VerifyReport:
        """``verify_chain``, then (when it passes) that every anchor agrees with the ledger: a
        head kept outside the database (ledger.anchor) is what catches a cut or rewritten tail."""
        report = self.verify_chain(progress, workers)
        if report.ok and anchors:
            found = check_anchors(anchors, report.num_events, lambda seq: bytes(self.peek_raw(seq)[10]))
            if found is not None:
                bad, problem = found
                return VerifyReport(ok=False, num_events=report.num_events, first_bad_seq=bad, problem=problem,
                                    last_hash=report.last_hash, checkpoints=report.checkpoints)
        return report

    def verify_chain(self, progress: Progress | None = None, workers: int | None = None) -> VerifyReport:
        """Check seq continuity, the hash chain, every payload, and that every row's audit columns
        are what its payload says (ledger.columns); ``progress(done, total)`` per batch.

        ``workers``: processes to spread a large ledger over (None: one per core for ledgers of
        200k+ events, never for an in-memory SQLite); see ledger.verify_parallel. Same verdict either way.
        """
        total = self.last_seq()
        if workers is None:
            workers = default_workers(total)
        if workers > 1 and total > 1 and not self._raw.memory:
            report = verify_parallel(self, total, min(workers, total), progress)
            if report is not None:
                return report
        return verify_batches(self.raw_batches(1, total, 20_000, audited=True), total, self.peek_raw, progress,
                              next_seq=self.next_seq)

    def export_jsonl(self, fp: IO[str]) -> int:
        """Write every event as one JSON object per line (see ledger.export); returns the count."""
        from residency.ledger.export import export_jsonl
        return export_jsonl(self, fp)

    @classmethod
    def import_jsonl(cls, url: str | URL, fp: IO[str], *, create: bool = False,
                     progress: Callable[[int], None] | None = None) -> int:
        """Load an export into the EMPTY ledger at ``url``, all or nothing; returns the count.

        Raises LedgerConflict (target not empty), LedgerCorrupt (a broken line, named; nothing written).
        """
        from residency.ledger.export import import_jsonl
        with cls.open(url, create=create) as store:
            return import_jsonl(store, fp, progress)


def _packed_sql(p: str) -> str:
    """One SQLite statement that packs the rows of ``[lo, hi]``, with parameters (hi, lo, hi):
    (rows, rows not at their type's current schema version, payloads concatenated in seq
    order, types joined by ",", payload lengths joined by ", ", ts_ns of row ``hi``).
    See ``LedgerStore.packed_runs``.

    NOTE: the rows are aggregated in the order of the scan, and the scan of a seq range is a
    walk of the table's B-tree by rowid (seq is the rowid; no index holds the payload), which
    visits rows in seq order: the plan is "SEARCH events USING INTEGER PRIMARY KEY"
    (tests/control/test_replay.py checks it) and our connections keep reverse_unordered_selects
    off. SQLite before 3.44 has no ORDER BY inside an aggregate, and an ordered subquery to
    aggregate over costs as much again as the whole aggregate. group_concat copies a BLOB's
    bytes as they are (no text conversion in a UTF-8 database); the CAST hands them back as a
    BLOB. ``events.codec.decode_packed`` checks every span.
    """
    older = f"count(*) FILTER (WHERE schema_version <> {_current_version_sql()})"
    return (f"SELECT count(*), {older}, CAST(group_concat(payload, '') AS BLOB), "
            f"group_concat(type, ','), group_concat(length(payload), ', '), "
            f"(SELECT ts_ns FROM events WHERE seq = {p}) "
            f"FROM events WHERE seq >= {p} AND seq <= {p}")


def _current_version_sql() -> str:
    """SQL for the current schema version of the row's type (1 unless the catalog says otherwise;
    a type the catalog does not know gets 1 here and fails ``decode_packed``'s type check)."""
    whens = " ".join(f"WHEN '{name}' THEN {cls.SCHEMA_VERSION}"
                     for name, cls in EVENT_TYPES.items() if cls.SCHEMA_VERSION != 1)
    return f"CASE type {whens} ELSE 1 END" if whens else "1"


def _check_schema(engine, u: URL) -> None:
    from residency.ledger import migrate

    rev = migrate.current(engine)
    if rev is None:
        raise NotALedger(f"{masked(u)} has no ledger schema; {init_hint(u)}")
    head = migrate.head()
    if rev == head:
        return
    if migrate.is_known(rev):
        raise SchemaOutOfDate(f"the ledger at {masked(u)} is at schema revision {rev} but this code needs {head}; "
                              f"run `residency ledger upgrade --db {masked(u)}`")
    raise SchemaOutOfDate(f"the ledger at {masked(u)} is at schema revision {rev}, which this code does not know "
                          f"(written by a newer Residency?); upgrade Residency to open it")
