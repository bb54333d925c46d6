"""Export to JSON lines and import back: byte-identical rows, all or nothing."""
from __future__ import annotations

import io
import json

import pytest

from residency.ledger import LedgerConflict, LedgerCorrupt, LedgerStore
from tests.ledger.factories import random_items


def _export(store) -> str:
    buf = io.StringIO()
    assert store.export_jsonl(buf) == store.last_seq()
    return buf.getvalue()


@pytest.fixture
def source(rng):
    with LedgerStore.open("sqlite:///:memory:", create=True) as store:
        for _ in range(rng.randint(2, 4)):
            store.append(random_items(rng, rng.randint(5, 40)))
        yield store


def test_export_then_import_reproduces_every_row_and_hash(source, ledger_store):
    text = _export(source)
    lines = text.splitlines()
    assert len(lines) == source.last_seq()
    first = json.loads(lines[0])
    assert {"seq", "ts_ns", "producer", "epoch", "producer_seq", "correlation_id", "causation", "type",
            "schema_version", "event", "row_hash"} <= set(first)
    assert first["event"]["type"] == first["type"] and len(first["row_hash"]) == 64
    # import into the backend under test (the fixture store is empty and open)
    from residency.ledger.export import import_jsonl
    assert import_jsonl(ledger_store, io.StringIO(text)) == source.last_seq()
    assert [tuple(r) for r in ledger_store.read_raw()] == [tuple(r) for r in source.read_raw()]
    report = ledger_store.verify()
    assert report.ok and report.last_hash == source.verify().last_hash
    assert _export(ledger_store) == text


def _break(lines: list[str], k: int, breakage: str, rng) -> int:
    """Damage line k (0-based) in place; returns the 1-based line number the import must name."""
    obj = json.loads(lines[k])
    if breakage == "hash":
        h = bytearray.fromhex(obj["row_hash"])
        h[rng.randrange(32)] ^= 1 << rng.randrange(8)
        obj["row_hash"] = h.hex()
    elif breakage == "field":
        obj["producer_seq"] += rng.randint(1, 5)
    elif breakage == "event":
        obj["event"]["type"] = "MoveTeleported"
    elif breakage == "truncated":
        lines[k] = lines[k][: rng.randrange(1, len(lines[k]))]
        return k + 1
    elif breakage == "dropped":
        k = min(k, len(lines) - 2)         # dropping the last line would leave a valid, shorter ledger
        del lines[k]
        return k + 1
    lines[k] = json.dumps(obj)
    return k + 1


@pytest.mark.parametrize("breakage", ["hash", "field", "event", "truncated", "dropped"])
def test_a_broken_export_imports_nothing_and_names_the_line(source, ledger_store, rng, breakage, monkeypatch):
    from residency.ledger import export as ledger_export

    monkeypatch.setattr(ledger_export, "IMPORT_BATCH", 3)    # several inserts before the broken line
    lines = _export(source).splitlines()
    line = _break(lines, rng.randrange(len(lines)), breakage, rng)
    from residency.ledger.export import import_jsonl
    with pytest.raises(LedgerCorrupt, match=rf"^line {line} \(seq {line}\) of the import is broken: "):
        import_jsonl(ledger_store, io.StringIO("\n".join(lines)))
    assert ledger_store.last_seq() == 0
    assert ledger_store.verify().ok


def test_import_by_url_is_all_or_nothing(source, tmp_path, rng):
    url = f"sqlite:///{tmp_path / 'imported.db'}"
    LedgerStore.open(url, create=True).close()
    lines = _export(source).splitlines()
    good = "\n".join(lines)
    line = _break(lines, rng.randrange(len(lines)), "hash", rng)
    with pytest.raises(LedgerCorrupt, match=f"^line {line} "):
        LedgerStore.import_jsonl(url, io.StringIO("\n".join(lines)))
    with LedgerStore.open(url) as store:
        assert store.last_seq() == 0
    assert LedgerStore.import_jsonl(url, io.StringIO(good)) == source.last_seq()


def test_import_refuses_a_ledger_that_already_has_events(source, ledger_store, rng):
    ledger_store.append(random_items(rng, 1))
    from residency.ledger.export import import_jsonl
    with pytest.raises(LedgerConflict, match="already holds events"):
        import_jsonl(ledger_store, io.StringIO(_export(source)))
    assert ledger_store.last_seq() == 1


def test_import_into_an_uninitialized_database_says_so_unless_asked_to_create(source, tmp_path):
    text = _export(source)
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    from residency.ledger import NotALedger
    with pytest.raises(NotALedger):
        LedgerStore.import_jsonl(url, io.StringIO(text))
    assert LedgerStore.import_jsonl(url, io.StringIO(text), create=True) == source.last_seq()
