"""Anchors: a head kept outside the database catches what the chain alone cannot, a cut tail and
a rewritten tail whose hashes were recomputed. Every backend."""
from __future__ import annotations

import json

import pytest

from residency.ledger import LedgerCorrupt, LedgerError, anchor
from tests.ledger.factories import random_event, random_items
from tests.ledger.tamper import rechain, run_unguarded


@pytest.fixture
def key(tmp_path, rng):
    path = tmp_path / "anchor.key"
    path.write_bytes(rng.randbytes(32))
    return anchor.load_key(path)


def _filled(store, rng) -> int:
    store.append(random_items(rng, rng.randint(20, 60)))
    return store.last_seq()


def test_a_cut_tail_verifies_alone_but_not_against_its_anchor(ledger_store, rng, tmp_path, key):
    n = _filled(ledger_store, rng)
    path = tmp_path / "heads.anchor"
    anchor.append(path, *ledger_store.head(), key)
    cut = rng.randint(1, n - 1)
    run_unguarded(ledger_store, "DELETE FROM events WHERE seq > :s", {"s": cut})
    assert ledger_store.verify().ok                      # the chain cannot see what is gone
    report = ledger_store.verify(anchors=anchor.read(path, key))
    assert not report.ok and report.first_bad_seq == n
    assert f"the ledger ends at seq {cut}" in report.problem and "cut" in report.problem
    assert f"{path} line 1" in report.problem


def test_a_rechained_tail_verifies_alone_but_not_against_its_anchor(ledger_store, rng, tmp_path, key):
    n = _filled(ledger_store, rng)
    path = tmp_path / "heads.anchor"
    anchor.append(path, *ledger_store.head(), key)
    ledger_store.append(random_items(rng, rng.randint(1, 10)))    # growth after an anchor is fine
    assert ledger_store.verify(anchors=anchor.read(path, key)).ok
    victim = rng.randint(1, n)
    run_unguarded(ledger_store, "UPDATE events SET producer = :p WHERE seq = :s", {"p": "mallory", "s": victim})
    rechain(ledger_store, victim)
    assert ledger_store.verify().ok
    report = ledger_store.verify(anchors=anchor.read(path, key))
    assert not report.ok and report.first_bad_seq == n
    assert f"rewritten at or before seq {n}" in report.problem


def test_several_anchors_name_the_first_that_disagrees(ledger_store, rng, tmp_path):
    path = tmp_path / "heads.anchor"
    heads = []
    for _ in range(3):
        _filled(ledger_store, rng)
        heads.append(ledger_store.head())
        anchor.append(path, *heads[-1], None)
    victim = rng.randint(heads[0][0] + 1, heads[1][0])
    run_unguarded(ledger_store, "UPDATE events SET ts_ns = ts_ns + 1 WHERE seq = :s", {"s": victim})
    rechain(ledger_store, victim)
    report = ledger_store.verify(anchors=anchor.read(path, None))
    assert report.first_bad_seq == heads[1][0] and f"{path} line 2" in report.problem


def test_expect_head_takes_what_verify_prints(ledger_store, rng):
    n = _filled(ledger_store, rng)
    head = ledger_store.verify().last_hash.hex()
    assert ledger_store.verify(anchors=[anchor.parse_head(f"{n}:{head}")]).ok
    other = rng.randbytes(32).hex()
    report = ledger_store.verify(anchors=[anchor.parse_head(f"{n}:{other}")])
    assert not report.ok and report.first_bad_seq == n and "--expect-head" in report.problem
    for bad in (f"{n}:{head[:16]}", f"x:{head}", f"0:{head}", head):
        with pytest.raises(LedgerError, match="not SEQ:HASH"):
            anchor.parse_head(bad)


def test_an_edited_or_unkeyed_anchor_line_is_refused_by_line(ledger_store, rng, tmp_path, key):
    _filled(ledger_store, rng)
    path = tmp_path / "heads.anchor"
    anchor.append(path, *ledger_store.head(), key)
    ledger_store.append([(random_items(rng, 1)[0][0], random_event(rng))])
    anchor.append(path, *ledger_store.head(), key)
    lines = path.read_text().splitlines()
    forged = json.loads(lines[1])
    forged["row_hash"] = rng.randbytes(32).hex()
    path.write_text(lines[0] + "\n" + json.dumps(forged) + "\n")
    with pytest.raises(LedgerCorrupt, match="line 2: its mac is wrong"):
        anchor.read(path, key)
    with pytest.raises(LedgerError, match="line 1 carries a mac"):
        anchor.read(path, None)
    del forged["mac"]
    path.write_text(lines[0] + "\n" + json.dumps(forged) + "\n")
    with pytest.raises(LedgerCorrupt, match="line 2 has no mac"):
        anchor.read(path, key)
    path.write_text("{not json\n")
    with pytest.raises(LedgerCorrupt, match="line 1 is not an anchor"):
        anchor.read(path, None)
    short = tmp_path / "short.key"
    short.write_bytes(rng.randbytes(8))
    with pytest.raises(LedgerError, match="8 bytes"):
        anchor.load_key(short)
