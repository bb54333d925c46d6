import json

import pytest

from residency.control.cli.main import main
from residency.control.diagnose.text import iso_ns
from residency.ledger import LedgerStore
from tests.diagnose.ledgers import SECOND


@pytest.fixture
def wedged_db(tmp_path, L):
    """A ledger whose last 20 s hold a move never acked while a request waits on it."""
    L.worker(0)
    for i in range(20):
        L.step(0, i, dt_ms=50)
        L.move(0, "spill", "device", "host", L.commit(0, 2), keep=True)
    session = L.uid("s")
    mid, req = L.request_move(0, "restore", "host", "device", L.commit(0, 2, tier="host", session=session),
                              session=session, deadline_ms=200)
    L.admit(session=session)
    L.chatter(20)
    url = f"sqlite:///{tmp_path}/wedged.db"
    with LedgerStore.open(url, create=True) as store:
        store.append([(r.envelope, r.event) for r in L.events])
    return url, mid, req, L


def test_diagnose_prints_the_wedge_with_its_proof_and_advice(wedged_db, capsys):
    url, mid, req, _ = wedged_db
    assert main(["diagnose", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "CRITICAL" in out and mid in out and f"seq {req.seq}" in out and "suggest:" in out
    assert "stall" in out


def test_diagnose_json_has_every_finding_with_its_seqs(wedged_db, capsys):
    url, mid, req, L = wedged_db
    assert main(["diagnose", "--db", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_events"] == len(L.events) and doc["at_seq"] == len(L.events)
    wedge = next(f for f in doc["findings"] if f["detector"] == "overdue_move")
    assert mid in wedge["title"] and req.seq in wedge["seqs"] and wedge["until_ns"] is None


def test_diagnose_at_a_seq_judges_the_ledger_as_it_stood_then(wedged_db, capsys):
    url, mid, req, _ = wedged_db
    assert main(["diagnose", "--db", url, "--at", str(req.seq + 1), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["at_seq"] == req.seq + 1 and doc["findings"] == []      # not yet past its deadline then


def test_diagnose_at_a_time_judges_at_that_time(wedged_db, capsys):
    url, mid, req, L = wedged_db
    when = req.event.deadline_ns + 2 * SECOND
    assert main(["diagnose", "--db", url, "--at", iso_ns(when), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert abs(doc["at_ns"] - when) < 1_000_000 and doc["at_seq"] < len(L.events)
    assert any(mid in f["title"] for f in doc["findings"])


@pytest.mark.parametrize("at, says", [
    ("999999", "beyond the end of the ledger (last seq"),
    ("0", "--at wants a seq of 1 or more"),
    ("2099-01-01T00:00:00Z", "beyond the end of the ledger (last event at"),
    ("2001-01-01T00:00:00Z", "before the ledger begins"),
    ("yesterday", "not an ISO 8601 time"),
])
def test_diagnose_at_outside_the_ledger_is_refused_by_name(wedged_db, capsys, at, says):
    url = wedged_db[0]
    assert main(["diagnose", "--db", url, "--at", at]) == 2
    cap = capsys.readouterr()
    assert says in cap.err and cap.out == "" and "Traceback" not in cap.err


def test_diagnose_of_a_file_that_is_not_a_ledger_names_the_problem(tmp_path, capsys):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database\n" * 100)
    assert main(["diagnose", "--db", f"sqlite:///{junk}"]) == 2
    err = capsys.readouterr().err
    # NOTE: the ledger words this "is not a ledger" or "... failed: file is not a database" depending on
    # where SQLite notices; either names the problem, and neither is a traceback
    assert ("not a ledger" in err or "not a database" in err) and "Traceback" not in err
    assert junk.read_bytes() == b"this is not a database\n" * 100


def test_diagnose_of_a_missing_ledger_creates_nothing(tmp_path, capsys):
    assert main(["diagnose", "--db", f"sqlite:///{tmp_path}/nowhere.db"]) == 2
    assert "no ledger at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_diagnose_rejects_a_malformed_group(wedged_db, capsys):
    assert main(["diagnose", "--db", wedged_db[0], "--group", "tp0=1"]) == 2
    assert "--group wants NAME=W,W" in capsys.readouterr().err


def test_diagnose_at_now_judges_a_silent_ledger_against_the_wall_clock(wedged_db, capsys):
    url, mid, req, L = wedged_db
    assert main(["diagnose", "--db", url, "--at", "now", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["at_seq"] == len(L.events) and doc["at_ns"] > L.now
    assert any(mid in f["title"] for f in doc["findings"])
