"""What an attacker (or a buggy tool) with SQL access can do to a ledger: write past the triggers."""
from __future__ import annotations

from sqlalchemy import text

from residency.ledger.chain import GENESIS, row_hash


def run_unguarded(store, sql: str, params: dict | None = None) -> None:
    """Execute ``sql`` with the append-only triggers out of the way, then put them back."""
    engine = store.engine
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            triggers = conn.execute(text(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'events'")).all()
            assert triggers, "the append-only triggers are missing"
            for name, _ in triggers:
                conn.exec_driver_sql(f"DROP TRIGGER {name}")
            conn.execute(text(sql), params or {})
            for _, ddl in triggers:
                conn.exec_driver_sql(ddl)
        else:
            conn.exec_driver_sql("ALTER TABLE events DISABLE TRIGGER USER")
            conn.execute(text(sql), params or {})
            conn.exec_driver_sql("ALTER TABLE events ENABLE TRIGGER USER")


def rechain(store, from_seq: int) -> None:
    """Recompute every row_hash from ``from_seq`` on, as a careful forger would."""
    rows = list(store.read_raw())
    prev = GENESIS if from_seq == 1 else rows[from_seq - 2].row_hash
    for r in rows[from_seq - 1:]:
        prev = row_hash(prev, r)
        run_unguarded(store, "UPDATE events SET row_hash = :h WHERE seq = :s", {"h": prev, "s": r.seq})


def insert_row(store, row: tuple, columns=("seq", "ts_ns", "producer", "epoch", "producer_seq", "type",
                                            "schema_version", "correlation_id", "causation", "payload", "row_hash")) -> None:
    """Insert a raw row through plain SQL (not the store): how an old or foreign writer would."""
    names = ", ".join(columns)
    marks = ", ".join(f":{c}" for c in columns)
    with store.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO events ({names}) VALUES ({marks})"), dict(zip(columns, row)))
