"""Verify a large ledger on several processes at once, with the same verdict as one pass.

Each link of the chain can be checked on its own: row n is sound when

    stored_hash(n) == SHA-256( stored_hash(n-1) || canonical(n) )

so a range a..b needs only the STORED hash of row a-1. If every range checks out then, by
induction from the genesis hash, every stored hash is the hash of its whole prefix: exactly what a
sequential pass proves. The first problem by seq wins, so ``first_bad_seq`` and ``problem`` are the
ones a sequential pass would report.

    ledger 1 ............................................................. N
           [ worker 0: 1..a-1 ][ worker 1: a..b-1 ][ worker 2: b..N ]
                              ^ prev = stored hash of a-1, read by the parent

The calling process verifies the first range itself; the others go to child processes
(``main(START, END, PREV_HEX)`` below, the URL in the environment, never on the command line) with
their own connections; they print ``progress N`` lines and one ``result {json}``. Processes, not
threads: hashing and decoding hold the GIL. A child on SQLite reads through plain ``sqlite3``
(read-only) and never imports SQLAlchemy: it starts in a third of the time. An in-memory SQLite
cannot be shared with another process, so it is always verified in one pass. If a worker dies
without a result, verification falls back to one pass (and says so in the log).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from residency.ledger.chain import GENESIS
from residency.ledger.verify import Progress, VerifyReport, verify_batches

if TYPE_CHECKING:
    from residency.ledger.store import LedgerStore

log = structlog.get_logger("ledger.verify")
# A worker costs ~0.3 s (SQLite) to ~1 s (PostgreSQL: SQLAlchemy imports) to start: below these
# sizes it costs more than it saves.
PARALLEL_MIN_EVENTS = 500_000
MIN_EVENTS_PER_WORKER = 250_000
_URL_ENV = "RESIDENCY_VERIFY_URL"
_SQLITE_ENV = "RESIDENCY_VERIFY_SQLITE_PATH"     # set for an SQLite file: the worker reads it with sqlite3
_WORKER = "import sys; from residency.ledger.verify_parallel import main; sys.exit(main(sys.argv[1:]))"


def default_workers(total: int) -> int:
    """One range per idle core (this process verifies one of them, so it counts as idle), at most 8.

    On a busy machine that is 1: a worker's start-up is CPU it would have to steal.
    """
    if total < PARALLEL_MIN_EVENTS:
        return 1
    cores = os.cpu_count() or 1
    try:
        idle = cores - os.getloadavg()[0] + 1
    except OSError:
        idle = cores
    return max(1, min(int(idle + 0.5), cores, 8, total // MIN_EVENTS_PER_WORKER))


def split(total: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering 1..total, as equal as possible."""
    step, extra = divmod(total, workers)
    out, start = [], 1
    for i in range(workers):
        end = start + step + (1 if i < extra else 0) - 1
        if end >= start:
            out.append((start, end))
        start = end + 1
    return out


def jobs(store: "LedgerStore", total: int, workers: int) -> list[tuple[int, int, bytes]]:
    """(start, end, stored hash of row start-1) per worker."""
    out = []
    for start, end in split(total, workers):
        before = store.peek_raw(start - 1) if start > 1 else None
        # a missing row start-1 is reported by the range before, which ends with it
        out.append((start, end, bytes(before[10]) if before is not None else GENESIS))
    return out


def verify_range(store: "LedgerStore", start: int, end: int, prev: bytes, progress: Progress | None = None) -> VerifyReport:
    """What one worker does (and what a test can run in-process)."""
    return verify_batches(store.raw_batches(start, end, 20_000, audited=True), end, store.peek_raw, progress,
                          start=start, prev=prev, next_seq=store.next_seq)


def _child_env(url: str, sqlite_path: str | None = None) -> dict[str, str]:
    # The child imports residency the way this process did: installed, or through an inherited PYTHONPATH.
    env = dict(os.environ)
    env[_URL_ENV] = url
    env.pop(_SQLITE_ENV, None)
    if sqlite_path is not None:
        env[_SQLITE_ENV] = sqlite_path
    return env


def verify_parallel(store: "LedgerStore", total: int, workers: int, progress: Progress | None) -> VerifyReport | None:
    """Verify 1..total in ``workers`` ranges: the first here, the others in child processes.

    None when a child failed (the caller falls back to one pass).
    """
    ranges = jobs(store, total, workers)
    u = store._raw.url
    sqlite_file = u.database if store.backend == "sqlite" and not store._raw.memory else None
    env = _child_env(u.render_as_string(hide_password=False), sqlite_file)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(start), str(end), prev.hex()],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for start, end, prev in ranges[1:]]
    lines: queue.Queue = queue.Queue()

    def pump(i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            lines.put((i, line))
        lines.put((i, None))

    for i, proc in enumerate(procs, 1):
        threading.Thread(target=pump, args=(i, proc), daemon=True, name="ledger-verify-pump").start()
    done = [0] * len(ranges)
    results: list[VerifyReport | None] = [None] * len(ranges)
    open_pipes = len(procs)

    def take(line_of: tuple[int, str | None]) -> None:
        nonlocal open_pipes
        i, line = line_of
        if line is None:
            open_pipes -= 1
        elif line.startswith("progress "):
            done[i] = int(line.split()[1])
        elif line.startswith("result "):
            r = json.loads(line[len("result "):])
            results[i] = VerifyReport(ok=r["ok"], num_events=r["num_events"], first_bad_seq=r["first_bad_seq"],
                                      problem=r["problem"], last_hash=bytes.fromhex(r["last_hash"]),
                                      checkpoints=[tuple(c) for c in r["checkpoints"]])

    def own_progress(n: int, _of: int) -> None:
        done[0] = n
        while True:                      # what the children said meanwhile
            try:
                take(lines.get_nowait())
            except queue.Empty:
                break
        if progress is not None:
            progress(sum(done), total)

    try:
        results[0] = verify_range(store, *ranges[0], own_progress)
    finally:
        while open_pipes:                # wait for every child, even when this range raised
            take(lines.get())
            if progress is not None:
                progress(sum(done), total)
        for i, proc in enumerate(procs, 1):
            proc.wait()
            if results[i] is None:
                log.warning("ledger_verify_parallel_failed", range=ranges[i][:2], returncode=proc.returncode,
                            stderr=proc.stderr.read()[-2000:])
            proc.stderr.close()
    if any(r is None for r in results):
        return None
    return combine(results)


def combine(results: list[VerifyReport]) -> VerifyReport:
    """Ranges' reports, in seq order, as one: sound up to the first range with a problem."""
    num_events, checkpoints = 0, []
    for r in results:
        num_events += r.num_events
        checkpoints += r.checkpoints
        if not r.ok:
            return VerifyReport(ok=False, num_events=num_events, first_bad_seq=r.first_bad_seq, problem=r.problem,
                                last_hash=r.last_hash, checkpoints=checkpoints)
    return VerifyReport(ok=True, num_events=num_events, last_hash=results[-1].last_hash, checkpoints=checkpoints)


def main(argv: list[str]) -> int:
    """A worker: verify START..END given the stored hash of START-1; report on stdout."""
    start, end, prev = int(argv[0]), int(argv[1]), bytes.fromhex(argv[2])
    on_progress = lambda done, _of: print(f"progress {done}", flush=True)  # noqa: E731
    path = os.environ.get(_SQLITE_ENV)
    if path:
        report = _verify_sqlite_range(path, start, end, prev, on_progress)
    else:
        from residency.ledger.backend import Raw, make_engine, parse_url
        from residency.ledger.store import LedgerStore

        u = parse_url(os.environ[_URL_ENV])
        with LedgerStore(Raw(make_engine(u, must_exist=True), u)) as store:   # the parent checked the schema
            report = verify_range(store, start, end, prev, on_progress)
    print("result " + json.dumps({
        "ok": report.ok, "num_events": report.num_events, "first_bad_seq": report.first_bad_seq,
        "problem": report.problem, "last_hash": report.last_hash.hex(), "checkpoints": report.checkpoints,
    }), flush=True)
    return 0


# ---------------------------------------------------------------------------- the SQLite worker
# The hashed columns, the row hash, then the audit columns (tests check this is ledger.schema.EVENT_COLUMNS;
# ledger.schema itself imports SQLAlchemy, which this worker does without).
EVENT_COLUMNS = ("seq", "ts_ns", "producer", "epoch", "producer_seq", "type", "schema_version",
                 "correlation_id", "causation", "payload", "row_hash",
                 "move_id", "worker", "session", "tier", "kind", "bytes")
_READ_SQL = f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE seq >= ? AND seq <= ? ORDER BY seq"
BATCH = 20_000


def _verify_sqlite_range(path: str, start: int, end: int, prev: bytes, progress: Progress) -> VerifyReport:
    """``verify_range`` over a read-only sqlite3 connection per thread (reads as ledger.store does)."""
    import sqlite3

    from residency.ledger.prefetch import prefetched

    uri = f"{Path(path).absolute().as_uri()}?mode=ro"

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA mmap_size = 268435456")
        conn.execute("PRAGMA cache_size = -65536")
        return conn

    def next_seq(seq: int) -> int | None:
        return conn.execute("SELECT min(seq) FROM events WHERE seq >= ?", (seq,)).fetchone()[0]

    def peek(seq: int) -> tuple | None:
        return conn.execute(_READ_SQL, (seq, seq)).fetchone()

    def batches():
        reader = connect()                # its own connection: it runs on the prefetch thread
        try:
            lo = start
            while lo <= end:
                hi = min(end, lo + BATCH - 1)
                rows = reader.execute(_READ_SQL, (lo, hi)).fetchall()
                if rows:
                    yield rows
                    lo = hi + 1
                else:                     # a gap (a damaged ledger): step to the next stored row
                    nxt = reader.execute("SELECT min(seq) FROM events WHERE seq >= ?", (lo,)).fetchone()[0]
                    if nxt is None:
                        return
                    lo = nxt
        finally:
            reader.close()

    conn = connect()
    try:
        return verify_batches(prefetched(batches()), end, peek, progress, start=start, prev=prev, next_seq=next_seq)
    finally:
        conn.close()
