"""A snapshot is used only when the hash chain vouches for it: a rewritten one is refused, by
seq, and replay (and a restart's recovery) fold from the events instead. Every backend."""
from __future__ import annotations

from sqlalchemy import text
from structlog.testing import capture_logs

from residency.control import recovery
from residency.control.replay import replay, write_snapshots
from residency.control.simulate import simulate
from residency.control.state import decode_state, encode_state, state_hash
from residency.events import encode_event
from residency.events.catalog import StateCheckpoint
from tests.ledger.tamper import run_unguarded


def _simulated(store, rng, n):
    items = list(simulate(n, seed=rng.randrange(1 << 30)))
    for k in range(0, n, 997):
        store.append(items[k:k + 997], durability="normal")


def _rewrite_snapshot(store, through: int, rng) -> None:
    """What a forger with SQL access does: another state, stored with its own correct hash."""
    with store.engine.begin() as conn:
        data = conn.execute(text("SELECT state_bytes FROM snapshots WHERE through_seq = :t"), {"t": through}).scalar_one()
        state = decode_state(bytes(data))
        state.num_refusals += rng.randint(1, 10**9)
        conn.execute(text("UPDATE snapshots SET state_bytes = :b, state_hash = :h WHERE through_seq = :t"),
                     {"b": encode_state(state), "h": state_hash(state), "t": through})


def test_a_snapshot_vouched_for_by_its_checkpoint_is_used(ledger_store, rng):
    n = rng.randint(600, 1500)
    _simulated(ledger_store, rng, n)
    every = rng.randint(100, 300)
    saved = write_snapshots(ledger_store, every)
    assert saved[-1] == n and ledger_store.last_seq() == n + len(saved)    # one StateCheckpoint each
    state, used = replay(ledger_store, n)
    assert used == n
    assert state_hash(state) == state_hash(replay(ledger_store, n, use_snapshots=False)[0])
    assert ledger_store.verify().ok


def test_a_rewritten_snapshot_is_refused_by_seq_and_replay_folds_the_events(ledger_store, rng):
    n = rng.randint(600, 1500)
    _simulated(ledger_store, rng, n)
    write_snapshots(ledger_store, n)
    want, _ = replay(ledger_store, n, use_snapshots=False)
    _rewrite_snapshot(ledger_store, n, rng)
    snap = ledger_store.load_snapshot(n)
    assert snap.refused is not None and f"through seq {n} is refused" in snap.refused
    with capture_logs() as logs:
        got, used = replay(ledger_store, n)
    assert used == 0 and state_hash(got) == state_hash(want)
    assert [(e["event"], e["through_seq"]) for e in logs if e["log_level"] == "warning"] == [("snapshot_refused", n)]
    with capture_logs():
        rec = recovery.replay(ledger_store)
    assert rec.from_snapshot == 0 and rec.num_replayed == ledger_store.last_seq()


def test_a_snapshot_whose_checkpoint_row_was_edited_is_refused(ledger_store, rng):
    n = rng.randint(300, 800)
    _simulated(ledger_store, rng, n)
    write_snapshots(ledger_store, n)
    cp = ledger_store.load_snapshot(n).checkpoint_seq
    # the forger rewrites the state and the checkpoint's hash inside the payload, but cannot
    # rechain without changing every later hash: the row no longer chains
    _rewrite_snapshot(ledger_store, n, rng)
    with ledger_store.engine.connect() as conn:
        forged_hash = conn.execute(text("SELECT state_hash FROM snapshots WHERE through_seq = :t"), {"t": n}).scalar_one()
    payload = encode_event(StateCheckpoint(through_seq=n, state_hash=forged_hash))
    run_unguarded(ledger_store, "UPDATE events SET payload = :p WHERE seq = :s", {"p": payload, "s": cp})
    snap = ledger_store.load_snapshot(n)
    assert snap.refused is not None and f"seq {cp}" in snap.refused and "does not chain" in snap.refused
    with capture_logs():
        assert replay(ledger_store, n)[1] == 0
