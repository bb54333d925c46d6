"""The ledger-reading commands as a user runs them: simulate, verify, replay, timeline, audit,
export/import, and a clear one-line error with a non-zero exit for each kind of bad input."""
from __future__ import annotations

import json
import random
import shutil
import sqlite3

import pytest

from residency.control.cli.main import main
from residency.control.replay import replay
from residency.control.simulate import simulate
from residency.control.state import State, state_hash
from residency.events import catalog as ev
from residency.events.envelope import Envelope
from residency.ledger import LedgerStore
from tests.ledger.tamper import run_unguarded


@pytest.fixture(scope="module")
def sim_db(tmp_path_factory):
    """6000 simulated events, then snapshots at 2000, 4000 and 6000, each vouched for by a
    StateCheckpoint the snapshot step appends: 6003 events."""
    path = tmp_path_factory.mktemp("cli") / "sim.db"
    url = f"sqlite:///{path}"
    assert main(["simulate", "--events", "6000", "--db", url, "--seed", str(random.randrange(1 << 20)),
                 "--snapshot-every", "2000"]) == 0
    return url, path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_a_simulated_ledger_checks_chain_and_checkpoints(sim_db, capsys):
    url, _ = sim_db
    code, out, err = run(capsys, "ledger", "verify", "--db", url)
    assert code == 0, err
    assert "6003 events" in out and "state checkpoints match replay" in out


def test_replay_json_at_a_seq_and_at_the_end(sim_db, capsys):
    url, _ = sim_db
    code, out, _ = run(capsys, "replay", "--db", url, "--at", "3000", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["seq"] == 3000 and s["integrity"] == "ok"
    assert {t for w in s["workers"] for t in w["tiers"]} == {"device", "host", "disk"}
    code, out, _ = run(capsys, "replay", "--db", url, "--json")
    end = json.loads(out)
    assert end["seq"] == 6003 and end["snapshot_seq"] == 6000


def test_replay_from_snapshot_equals_replay_from_zero(sim_db):
    url, _ = sim_db
    with LedgerStore.open(url) as store:
        for at in (1999, 2000, 4321, 6000):
            a, snap = replay(store, at)
            b, none = replay(store, at, use_snapshots=False)
            assert none == 0 and a.state_hash() == b.state_hash()
            assert snap == (at // 2000) * 2000


def test_replay_diff_names_what_changed(sim_db, capsys):
    url, _ = sim_db
    code, out, _ = run(capsys, "replay", "--db", url, "--diff", "100..3000")
    assert code == 0 and out.startswith("from seq 100")
    assert "used_bytes" in out


def test_timeline_of_a_move_follows_it_to_its_outcome(sim_db, capsys):
    url, _ = sim_db
    code, out, _ = run(capsys, "timeline", "--db", url, "--subject", "move:m-5")
    lines = out.strip().splitlines()
    assert code == 0 and "MoveRequested" in lines[0]
    assert any(t in lines[-1] for t in ("MoveAcked", "MoveFailed", "MoveRejected", "MoveStranded", "MoveLateAcked",
                                        "CopiesReleased", "SessionParked", "SessionRestored"))


def test_timeline_of_a_block_key_starts_where_it_was_committed(sim_db, capsys):
    url, _ = sim_db
    with LedgerStore.open(url) as store:
        committed = next(r for r in store.read() if isinstance(r.event, ev.BlocksCommitted))
    key = committed.event.keys[0]
    code, out, _ = run(capsys, "timeline", "--db", url, "--subject", f"block:{key}")
    assert code == 0 and out.splitlines()[0].split()[0] == str(committed.seq)


def test_audit_stranded_agrees_with_the_fold_and_the_sql_view(sim_db, capsys):
    url, _ = sim_db
    code, out, _ = run(capsys, "audit", "stranded", "--db", url, "--by", "worker", "--json")
    assert code == 0
    audit = json.loads(out)
    with LedgerStore.open(url) as store:
        state, _ = replay(store)
    assert audit["total_bytes"] == state.stranded_bytes_total()
    code, out, _ = run(capsys, "audit", "reclaimed", "--db", url, "--by", "tier", "--json")
    rec = json.loads(out)
    by_tier = {g["group"]: g["bytes"] for g in rec["groups"]}
    for t in ("device", "host", "disk"):
        assert by_tier.get(t, 0) == sum(w.tiers[t].reclaimed_bytes for w in state.workers.values())


def test_audit_refuses_a_ledger_whose_audit_columns_were_edited(sim_db, tmp_path, capsys):
    """A 4 MiB move's bytes column set to 390 GiB: the chain does not cover the column, so audit
    verifies first and names the seq instead of printing the forged total."""
    _, path = sim_db
    copy = tmp_path / "edited.db"
    shutil.copy(path, copy)
    url = f"sqlite:///{copy}"
    with LedgerStore.open(url) as store:
        acks = [r.seq for r in store.read_raw() if r.type == "MoveAcked"]
        seq = random.choice(acks)
        run_unguarded(store, "UPDATE events SET bytes = :b WHERE seq = :s", {"b": 390 << 30, "s": seq})
    code, out, err = run(capsys, "audit", "reclaimed", "--db", url, "--by", "tier")
    assert code == 2 and out == ""
    assert f"seq {seq}: its audit columns were edited (bytes is {390 << 30}" in err


def test_verify_prints_the_full_head_and_checks_it_and_anchor_files(sim_db, tmp_path, capsys):
    """What an operator does: keep the head `verify` prints (or an anchor file) elsewhere; a
    ledger whose tail was then cut verifies alone but fails against it, naming the seq."""
    _, path = sim_db
    copy = tmp_path / "copy.db"
    shutil.copy(path, copy)
    url = f"sqlite:///{copy}"
    code, out, _ = run(capsys, "ledger", "verify", "--db", url, "--no-checkpoints")
    head = out.splitlines()[-1].split()[1]
    seq, digest = head.split(":")
    assert code == 0 and seq == "6003" and len(digest) == 64
    key = tmp_path / "k"
    key.write_bytes(random.randbytes(32))
    anchors = tmp_path / "heads.anchor"
    code, out, err = run(capsys, "ledger", "anchor", "--db", url, "--anchor", str(anchors), "--anchor-key", str(key))
    assert code == 0 and head in out, err
    with LedgerStore.open(url) as store:
        run_unguarded(store, "DELETE FROM events WHERE seq > 6000")
    code, out, err = run(capsys, "ledger", "verify", "--db", url, "--no-checkpoints")
    assert code == 0                                    # the chain alone cannot tell
    code, out, err = run(capsys, "ledger", "verify", "--db", url, "--expect-head", head)
    assert code == 1 and "FAILED: seq 6003: the ledger ends at seq 6000" in err
    code, out, err = run(capsys, "ledger", "verify", "--db", url, "--anchor", str(anchors), "--anchor-key", str(key))
    assert code == 1 and "FAILED: seq 6003:" in err and "line 1" in err
    code, out, err = run(capsys, "ledger", "anchor", "--db", url, "--anchor", str(anchors), "--anchor-key", str(key))
    assert code == 1 and "no anchor written" in err and len(anchors.read_text().splitlines()) == 1


def test_import_into_a_new_ledger_needs_no_init(sim_db, tmp_path, capsys):
    url, _ = sim_db
    dump = tmp_path / "l.jsonl"
    assert main(["ledger", "export", "--db", url, "-o", str(dump)]) == 0
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    code, out, err = run(capsys, "ledger", "import", str(dump), "--db", fresh)
    assert code == 0, err
    with LedgerStore.open(fresh) as store, LedgerStore.open(url) as original:
        assert store.verify().last_hash == original.verify().last_hash


def test_export_import_round_trip_and_a_broken_export_writes_nothing(sim_db, tmp_path, capsys):
    url, _ = sim_db
    dump = tmp_path / "l.jsonl"
    assert main(["ledger", "export", "--db", url, "-o", str(dump)]) == 0
    copy = f"sqlite:///{tmp_path / 'copy.db'}"
    assert main(["ledger", "init", "--db", copy]) == 0
    assert main(["ledger", "import", str(dump), "--db", copy]) == 0
    code, out, _ = run(capsys, "ledger", "verify", "--db", copy)
    assert code == 0 and "6003 events" in out
    lines = dump.read_text().splitlines()
    victim = random.randrange(10, len(lines))
    obj = json.loads(lines[victim])
    obj["ts_ns"] += 1
    lines[victim] = json.dumps(obj)
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert main(["ledger", "init", "--db", fresh]) == 0
    code, _, err = run(capsys, "ledger", "import", str(tmp_path / "bad.jsonl"), "--db", fresh)
    assert code != 0 and str(obj["seq"]) in err
    with LedgerStore.open(fresh) as store:
        assert store.last_seq() == 0


def test_verify_names_the_seq_of_a_row_edited_behind_the_triggers(sim_db, tmp_path, capsys):
    _, path = sim_db
    victim = tmp_path / "edited.db"
    victim.write_bytes(path.read_bytes())
    seq = random.randrange(100, 5000)
    con = sqlite3.connect(victim)
    triggers = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='trigger'")]
    for t in triggers:
        con.execute(f"DROP TRIGGER {t}")
    con.execute("UPDATE events SET ts_ns = ts_ns + 1 WHERE seq = ?", (seq,))
    con.commit()
    con.close()
    code, _, err = run(capsys, "ledger", "verify", "--db", f"sqlite:///{victim}")
    assert code == 1 and f"seq {seq}" in err


def test_verify_catches_a_checkpoint_that_disagrees_with_replay(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    items = list(simulate(300, seed=random.randrange(1 << 20)))
    lie = ev.StateCheckpoint(through_seq=200, state_hash=state_hash(State())[:3] + "%064x" % random.getrandbits(256))
    items.append((Envelope(producer="control", epoch=1, producer_seq=1, ts_ns=items[-1][0].ts_ns + 1), lie))
    with LedgerStore.open(url, create=True) as store:
        store.append(items)
    code, _, err = run(capsys, "ledger", "verify", "--db", url)
    assert code == 1 and "seq 301: StateCheckpoint through seq 200" in err


def test_a_checkpoint_an_earlier_fold_wrote_is_named_not_compared(tmp_path, capsys):
    """A ledger written before the fold changed (bare-hex checkpoints, version 1) still verifies:
    its checkpoints cannot be reproduced by this fold, and the output says how many were left."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    items = list(simulate(300, seed=random.randrange(1 << 20)))
    old = ev.StateCheckpoint(through_seq=200, state_hash="%064x" % random.getrandbits(256))
    items.append((Envelope(producer="control", epoch=1, producer_seq=1, ts_ns=items[-1][0].ts_ns + 1), old))
    with LedgerStore.open(url, create=True) as store:
        store.append(items)
    code, out, _ = run(capsys, "ledger", "verify", "--db", url)
    assert code == 0 and "(1 written by an earlier version of the fold, not compared)" in out


@pytest.mark.parametrize("argv, needle", [
    (["replay", "--db", "sqlite:///{tmp}/missing.db"], "no ledger at"),
    (["replay", "--db", "sqlite:///{tmp}/garbage.db"], "is not a ledger"),
    (["replay", "--db", "{sim}", "--at", "999999"], "beyond the end of the ledger (last seq 6003)"),
    (["replay", "--db", "{sim}", "--diff", "5..x"], "--diff wants A..B"),
    (["replay", "--db", "{sim}", "--at-time", "yesterday"], "not an ISO 8601 time"),
    (["timeline", "--db", "{sim}", "--subject", "table:1"], "subject must be one of"),
    (["timeline", "--db", "{sim}", "--subject", "move:no-such-move"], "no event in the ledger touches"),
    (["audit", "stranded", "--db", "{sim}", "--since", "2030-01-01", "--until", "2029-01-01"], "--since is after"),
    (["ledger", "verify", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/x"], "cannot reach"),
    (["simulate", "--events", "10", "--db", "{sim}"], "not empty"),
])
def test_bad_input_is_one_clear_line_and_a_nonzero_exit(sim_db, tmp_path, capsys, argv, needle):
    (tmp_path / "garbage.db").write_bytes(random.randbytes(8192))
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{sim}", sim_db[0]) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "missing.db").exists()


def test_timeline_json_shows_an_acks_checksums_as_hex_per_block(tmp_path, capsys):
    import json
    import os

    from residency.events import catalog as ev
    from residency.events.envelope import Envelope
    from residency.ledger import LedgerStore
    url = f"sqlite:///{tmp_path / 'acks.db'}"
    sums = os.urandom(3 * 8)
    events = [ev.MoveRequested(move_id="m-1", kind="evict", worker=0, src="device", dst="host", blocks=[7, 3, 9],
                               bytes_planned=3 * 4096, keep_source=False, deadline_ns=1, reason="test"),
              ev.MoveAcked(move_id="m-1", worker=0, bytes_moved=3 * 4096, bytes_freed_src=3 * 4096, checksum_ok=True,
                           started_ns=1, finished_ns=2, checksums=sums)]
    with LedgerStore.open(url, create=True) as store:
        store.append([(Envelope(producer="test", epoch=1, producer_seq=i + 1, ts_ns=i + 1), e)
                      for i, e in enumerate(events)])
    code, out, _ = run(capsys, "timeline", "--db", url, "--subject", "move:m-1", "--json")
    shown = [json.loads(line)["event"] for line in out.strip().splitlines()]
    assert code == 0 and [e["type"] for e in shown] == ["MoveRequested", "MoveAcked"]
    assert shown[1]["checksums"] == [f"{int.from_bytes(sums[i:i + 8], 'little'):016x}" for i in range(0, 24, 8)]
