"""Audit columns and the residency_reclaimed / residency_stranded views, in plain SQL."""
from __future__ import annotations

import pytest
from sqlalchemy import text

from residency.control.replay import replay
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
    w6 = app("WorkerLost", worker=3, reason="heartbeat", bytes_lost=(y6 := b()))
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
        (w6, 3, None, None, None, "blocks_lost", "heartbeat", y6),
    ]
    assert {k: int(v) for k, v in by_cause.items()} == {"evict": x1, "spill": 0, "park": x3, "finished": x5}


@pytest.mark.parametrize("view", ["residency_reclaimed", "residency_stranded"])
def test_views_are_empty_on_an_empty_ledger(ledger_store, view):
    with ledger_store.engine.connect() as conn:
        assert conn.execute(text(f"SELECT COUNT(*) FROM {view}")).scalar_one() == 0


def test_a_stranding_on_a_worker_lost_later_is_counted_once_by_the_loss(ledger_store, rng):
    """A move stranded by its deadline, then its worker lost; a move in flight at a loss, stranded
    right after it (why=worker_lost); and, after the worker rejoined, a stranding of the new
    incarnation, which still counts. The view and replay give the same total, each byte once."""
    app = Script(ledger_store, rng)
    bb = rng.randrange(1, 1 << 10) * 4096
    tiers = {"device": 1 << 40, "host": 1 << 40, "disk": 1 << 40}
    n = [rng.randint(1, 6) for _ in range(4)]
    blocks = [list(range(100 * i, 100 * i + k)) for i, k in enumerate(n)]

    def move(mid, bl):
        app("MoveRequested", move_id=mid, kind="evict", worker=0, src="device", dst="host", blocks=bl,
            bytes_planned=len(bl) * bb, keep_source=False, session=None)

    app("WorkerJoined", worker=0, device="cpu", tiers=tiers, block_bytes=bb)
    app("BlocksCommitted", worker=0, session=None, tier="device", blocks=blocks[0] + blocks[1] + blocks[2],
        keys=[""] * (n[0] + n[1] + n[2]), bytes=(n[0] + n[1] + n[2]) * bb)
    move("m1", blocks[0])
    app("MoveStranded", move_id="m1", worker=0, bytes_at_risk=n[0] * bb, why="deadline")
    move("m2", blocks[1])
    on_worker = sorted(blocks[0] + blocks[1] + blocks[2])
    lost = app("WorkerLost", worker=0, reason="kill -9", blocks_lost=on_worker, bytes_lost=len(on_worker) * bb,
               kept_on_disk=[], bytes_kept=0)
    app("MoveStranded", move_id="m2", worker=0, bytes_at_risk=n[1] * bb, why="worker_lost")
    app("WorkerJoined", worker=0, device="cpu", tiers=tiers, block_bytes=bb)
    app("BlocksCommitted", worker=0, session=None, tier="device", blocks=blocks[3], keys=[""] * n[3], bytes=n[3] * bb)
    move("m4", blocks[3])
    st4 = app("MoveStranded", move_id="m4", worker=0, bytes_at_risk=n[3] * bb, why="deadline")

    with ledger_store.engine.connect() as conn:
        rows = conn.execute(text("SELECT seq, move_id, why, bytes FROM residency_stranded ORDER BY seq")).all()
    assert [tuple(r) for r in rows] == [(lost, None, "blocks_lost", len(on_worker) * bb),
                                        (st4, "m4", "deadline", n[3] * bb)]
    state, _ = replay(ledger_store)
    state.check_integrity()
    assert state.stranded_bytes_total() == sum(r[3] for r in rows) == (len(on_worker) + n[3]) * bb
