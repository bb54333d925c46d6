"""Audit columns and the residency_reclaimed / residency_stranded views, in plain SQL."""
from __future__ import annotations

import pytest
from sqlalchemy import text

from residency.events import Envelope
from residency.events.catalog import EVENT_TYPES
from residency.ledger.columns import NAMES, columns_of
from tests.ledger.factories import random_event


class Script:
    """Appends events from one producer with consecutive producer_seqs."""

    def __init__(self, store, rng):
        self.store, self.rng, self.n = store, rng, 0

    def __call__(self, type_name, **fields) -> int:
        self.n += 1
        env = Envelope(producer="control", epoch=1, producer_seq=self.n, ts_ns=10**18 + self.n * 1000)
        return self.store.append([(env, random_event(self.rng, type_name, **fields))])[0]


def test_every_event_gets_its_audit_columns(ledger_store, rng):
    events = [random_event(rng, name) for name in sorted(EVENT_TYPES) for _ in range(2)]
    rng.shuffle(events)
    ledger_store.append([(Envelope(producer="p", epoch=1, producer_seq=i + 1, ts_ns=i), ev) for i, ev in enumerate(events)])
    with ledger_store.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {', '.join(NAMES)} FROM events ORDER BY seq")).all()
    assert [tuple(r) for r in rows] == [columns_of(ev) for ev in events]
    mr = random_event(rng, "MoveRequested")
    assert columns_of(mr) == (mr.move_id, mr.worker, mr.session, mr.src, mr.kind, mr.bytes_planned)
    bf = random_event(rng, "BlocksFreed")
    assert columns_of(bf) == (None, bf.worker, None, bf.tier, bf.reason, bf.bytes)
    failed = random_event(rng, "MoveFailed", bytes_moved=None)
    assert columns_of(failed)[5] is None            # not measured stays None, never 0


def test_reclaimed_and_stranded_answer_the_audit_definitions(ledger_store, rng):
    app = Script(ledger_store, rng)
    b = lambda: rng.randrange(1, 1 << 40)  # noqa: E731
    s1, s2 = f"s-{rng.randrange(1 << 30)}", f"s-{rng.randrange(1 << 30)}"
    # an evict acked, a write-through spill that freed 0, a move stranded then late-acked,
    # a move stranded for good, blocks freed, a worker lost
    app("MoveRequested", move_id="m1", kind="evict", worker=0, src="device", dst="host", session=s1)
    a1 = app("MoveAcked", move_id="m1", worker=0, bytes_freed_src=(x1 := b()))
    app("MoveRequested", move_id="m2", kind="spill", worker=0, src="host", dst="disk", session=None, keep_source=True)
    a2 = app("MoveAcked", move_id="m2", worker=0, bytes_freed_src=0)
    app("MoveRequested", move_id="m3", kind="park", worker=1, src="device", dst="host", session=s2)
    app("MoveStranded", move_id="m3", worker=1, bytes_at_risk=b(), why="deadline")
    a3 = app("MoveLateAcked", move_id="m3", worker=1, bytes_freed_src=(x3 := b()))
    app("MoveRequested", move_id="m4", kind="restore", worker=2, src="host", dst="device", session=s1)
    st4 = app("MoveStranded", move_id="m4", worker=2, bytes_at_risk=(y4 := b()), why="worker_lost")
    f5 = app("BlocksFreed", worker=1, tier="host", bytes=(x5 := b()), reason="finished")
    w6 = app("WorkerLost", worker=2, reason="heartbeat", bytes_lost=(y6 := b()))
    app("MoveFailed", move_id="m9", worker=0, bytes_moved=None)   # no ack: reclaims nothing

    with ledger_store.engine.connect() as conn:
        reclaimed = conn.execute(text(
            "SELECT seq, worker, tier, cause, session, move_id, bytes FROM residency_reclaimed ORDER BY seq")).all()
        stranded = conn.execute(text(
            "SELECT seq, worker, tier, session, move_id, why, detail, bytes FROM residency_stranded ORDER BY seq")).all()
        by_cause = dict(conn.execute(text(
            "SELECT cause, SUM(bytes) FROM residency_reclaimed GROUP BY cause")).all())
    assert [tuple(r) for r in reclaimed] == [
        (a1, 0, "device", "evict", s1, "m1", x1),
        (a2, 0, "host", "spill", None, "m2", 0),
        (a3, 1, "device", "park", s2, "m3", x3),
        (f5, 1, "host", "finished", None, None, x5),
    ]
    assert [tuple(r) for r in stranded] == [
        (st4, 2, "host", s1, "m4", "worker_lost", None, y4),
        (w6, 2, None, None, None, "blocks_lost", "heartbeat", y6),
    ]
    assert {k: int(v) for k, v in by_cause.items()} == {"evict": x1, "spill": 0, "park": x3, "finished": x5}


@pytest.mark.parametrize("view", ["residency_reclaimed", "residency_stranded"])
def test_views_are_empty_on_an_empty_ledger(ledger_store, view):
    with ledger_store.engine.connect() as conn:
        assert conn.execute(text(f"SELECT COUNT(*) FROM {view}")).scalar_one() == 0
