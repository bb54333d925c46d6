"""Alembic migrations: no drift from ledger.schema, every version up and down, runnable when installed."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from residency.ledger import LedgerStore, migrate
from residency.ledger.backend import make_engine
from residency.ledger.schema import VIEWS, metadata
from tests.ledger.factories import random_items

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(ledger_url):
    if ledger_url == "sqlite:///:memory:":
        pytest.skip("each engine on :memory: is a new database; the file and PostgreSQL cover migrations")
    return ledger_url


def _objects(url) -> tuple[set, set, str | None]:
    engine = make_engine(url)
    try:
        insp = inspect(engine)
        tables = set(insp.get_table_names()) - {"alembic_version"}
        views = set(insp.get_view_names())
    finally:
        engine.dispose()
    return tables, views, migrate.current(url)


def test_the_migrations_build_exactly_the_metadata(url):
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
    finally:
        engine.dispose()
    assert diff == []
    assert _objects(url) == ({"events", "snapshots"}, set(VIEWS), migrate.head())


def test_every_version_upgrades_and_downgrades(url, rng):
    revs = migrate.revisions()
    assert revs[-1] == migrate.head() and len(revs) >= 2
    for rev in revs:                                   # up, one version at a time
        migrate.upgrade(url, rev)
        assert migrate.current(url) == rev
    with LedgerStore.open(url) as store:               # with events in it
        store.append(random_items(rng, rng.randint(1, 20)))
    for rev in reversed(revs[:-1]):                    # down, one version at a time
        migrate.downgrade(url, rev)
        assert migrate.current(url) == rev
    assert _objects(url)[1] == set()                   # the views came with 0002
    migrate.downgrade(url, "base")
    assert _objects(url) == (set(), set(), None)
    migrate.upgrade(url)
    with LedgerStore.open(url) as store:
        assert store.last_seq() == 0 and store.verify().ok


def test_an_unknown_revision_is_a_ledger_error(tmp_path):
    from residency.ledger import LedgerError
    with pytest.raises(LedgerError, match="upgrading the ledger schema to nope failed"):
        migrate.upgrade(f"sqlite:///{tmp_path / 'x.db'}", "nope")


def test_migrations_run_from_an_installed_copy_in_another_directory(tmp_path):
    """Lay the packages out as setuptools installs them (package-data globs from pyproject) and
    migrate from a different working directory: nothing may depend on the repository root."""
    site = tmp_path / "site"
    for pkg in ("events", "ledger"):
        shutil.copytree(REPO / pkg, site / "residency" / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    mig = site / "residency" / "migrations"
    (mig / "versions").mkdir(parents=True)
    for pattern in ("*.py", "*.ini", "*.mako", "versions/*.py"):     # modules + [tool.setuptools.package-data]
        for f in (REPO / "migrations").glob(pattern):
            shutil.copy(f, mig / f.relative_to(REPO / "migrations"))
    work = tmp_path / "elsewhere"
    work.mkdir()
    db = tmp_path / "installed.db"
    code = ("from residency.ledger import migrate, LedgerStore; import residency.migrations as migrations; "
            f"assert migrations.__file__.startswith({str(site)!r}), migrations.__file__; "
            f"migrate.upgrade('sqlite:///{db}'); print(migrate.current('sqlite:///{db}')); "
            f"LedgerStore.open('sqlite:///{db}').close()")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                         cwd=work, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == migrate.head()


def _indexes(url) -> set[str]:
    engine = make_engine(url)
    try:
        return {ix["name"] for ix in inspect(engine).get_indexes("events")}
    finally:
        engine.dispose()


def _audit(url) -> tuple[list, list]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return tuple(sorted(map(tuple, conn.exec_driver_sql(f"SELECT * FROM {v}").all()), key=repr) for v in VIEWS)
    finally:
        engine.dispose()


def test_0003_trades_the_session_and_move_indexes_for_the_two_view_lookups_and_back(url):
    """Rows written under 0002 verify, and the audit views answer the same, after 0003 and after
    going back down; only the index set changes."""
    from residency.control.simulate import simulate

    migrate.upgrade(url, "0002")
    with LedgerStore(_raw(url)) as store:
        items = list(simulate(3000, seed=3))
        store.append(items[:1500])
        store.append(items[1500:])
    before = _audit(url)
    old = {"ix_events_session", "ix_events_move_id"}
    new = {"ix_events_move_requested", "ix_events_move_late_acked"}
    assert old <= _indexes(url) and not new & _indexes(url)
    migrate.upgrade(url, "0003")
    assert new <= _indexes(url) and not old & _indexes(url)
    assert _audit(url) == before and before[0] and before[1]
    with LedgerStore(_raw(url)) as store:                # 0003 is no longer head: open it as it is
        report = store.verify(workers=1)
        assert report.ok and report.num_events == 3000
    migrate.downgrade(url, "0002")
    assert old <= _indexes(url) and not new & _indexes(url)
    assert _audit(url) == before


def _raw(url):
    """A store on a schema that is not head (LedgerStore.open would refuse it): for writing old rows."""
    from residency.ledger.backend import Raw, parse_url
    u = parse_url(url)
    return Raw(make_engine(u), u)


def test_the_audit_views_look_moves_up_by_index_on_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            plans = {v: " | ".join(r[3] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN SELECT * FROM {v}"))
                     for v in VIEWS}
    finally:
        engine.dispose()
    assert "SEARCH r USING INDEX ix_events_move_requested" in plans["residency_reclaimed"]
    assert "SEARCH r USING INDEX ix_events_move_requested" in plans["residency_stranded"]
    assert "SEARCH l USING INDEX ix_events_move_late_acked" in plans["residency_stranded"]
    assert "SEARCH w USING INDEX ix_events_worker_lost" in plans["residency_stranded"]


def test_0004_the_audit_views_read_copies_released_and_old_ledgers_answer_as_before(url):
    """A ledger whose releases are the two rows of before (ack, BlocksFreed) answers the same
    after 0004; one with CopiesReleased rows gets its release bytes and resolved strandings only
    from 0004 on; going back down restores the 0002 views."""
    from tests.control.test_release_forms import BB, _write

    migrate.upgrade(url, "0003")
    with LedgerStore(_raw(url)) as store:
        _write(store, "old")
    before = _audit(url)
    migrate.upgrade(url, "0004")
    assert _audit(url) == before and "ix_events_copies_released" in _indexes(url)
    with LedgerStore(_raw(url)) as store:             # at 0004, whatever the head is now
        _write(store, "new", epoch=2, prefix="new-")
    reclaimed, stranded = _audit(url)
    new_rows = [r for r in reclaimed if r[4] == "release" and r[6] is not None]   # (seq, ts, worker, tier,
    #                                                                   cause, session, move_id, bytes)
    assert sum(r[7] for r in new_rows) == 5 * BB            # the CopiesReleased rows, cause 'release'
    assert sorted(r[5] for r in stranded) == ["new-r4", "r4"]     # r3 answered late: resolved in both forms
    migrate.downgrade(url, "0003")
    assert "ix_events_copies_released" not in _indexes(url)
    reclaimed, stranded = _audit(url)
    assert not [r for r in reclaimed if r[6] is not None and r[4] == "release"]
    assert sorted(r[5] for r in stranded) == ["new-r3", "new-r4", "r4"]    # 0002 knew only MoveLateAcked


def test_0005_a_stranding_on_a_worker_lost_later_is_counted_once_in_old_ledgers_too(url, rng):
    """A ledger written before 0005 with a move stranded on a worker, then that worker lost (both
    rows name the same bytes): after 0005 the view counts the loss's row only, as replay does;
    downgrade restores the 0004 view (which counted both) and drops the index."""
    from residency.control.replay import replay
    from residency.events import Envelope
    from tests.ledger.factories import random_event

    migrate.upgrade(url, "0004")
    bb, k = rng.randrange(1, 64) * 4096, rng.randint(1, 9)
    blocks = sorted(rng.sample(range(1000), k))
    events = [
        random_event(rng, "WorkerJoined", worker=0, device="cpu", tiers={"device": 1 << 30, "host": 0, "disk": 0},
                     block_bytes=bb),
        random_event(rng, "BlocksCommitted", worker=0, session=None, tier="device", blocks=blocks, keys=[""] * k,
                     bytes=k * bb),
        random_event(rng, "MoveRequested", move_id="m", kind="evict", worker=0, src="device", dst="host",
                     blocks=blocks, bytes_planned=k * bb, keep_source=False, session=None),
        random_event(rng, "WorkerLost", worker=0, reason="kill -9", blocks_lost=blocks, bytes_lost=k * bb,
                     kept_on_disk=[], bytes_kept=0),
        random_event(rng, "MoveStranded", move_id="m", worker=0, bytes_at_risk=k * bb, why="worker_lost"),
    ]
    with LedgerStore(_raw(url)) as store:
        store.append([(Envelope(producer="control", epoch=1, producer_seq=i + 1, ts_ns=i + 1), e)
                      for i, e in enumerate(events)])
    assert sum(r[-1] for r in _audit(url)[1]) == 2 * k * bb
    migrate.upgrade(url, "0005")
    assert "ix_events_worker_lost" in _indexes(url)
    stranded = _audit(url)[1]
    assert [r[6] for r in stranded] == ["blocks_lost"] and sum(r[-1] for r in stranded) == k * bb
    migrate.upgrade(url)                                 # the store of today reads the snapshots table of the head
    with LedgerStore(_raw(url)) as store:
        assert replay(store)[0].stranded_bytes_total() == k * bb
    migrate.downgrade(url, "0004")
    assert "ix_events_worker_lost" not in _indexes(url) and sum(r[-1] for r in _audit(url)[1]) == 2 * k * bb
