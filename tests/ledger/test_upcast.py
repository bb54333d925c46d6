"""A row stored under an older schema still reads, verifies and round-trips through export."""
from __future__ import annotations

import io

import msgspec

from residency.events.catalog import BlocksFreed
from residency.ledger.chain import row_hash
from residency.ledger.export import import_jsonl
from tests.ledger.factories import random_items
from tests.ledger.tamper import insert_row


def test_a_stored_blocks_freed_v1_row_is_upcast_on_read(ledger_store, rng):
    ledger_store.append(random_items(rng, rng.randint(1, 10)))
    last = list(ledger_store.read_raw())[-1]
    worker, blocks = rng.randrange(8), [rng.randrange(1 << 20) for _ in range(rng.randint(1, 6))]
    num_bytes, reason = rng.randrange(1 << 40), rng.choice(["finished", "disconnected", "dropped"])
    # v1 had no tier: [type, worker, blocks, bytes, reason]
    payload = msgspec.msgpack.encode(["BlocksFreed", worker, blocks, num_bytes, reason])
    row = (last.seq + 1, rng.randrange(1 << 62), "control", 1, rng.randrange(1 << 40), "BlocksFreed", 1,
           None, None, payload)
    insert_row(ledger_store, (*row, row_hash(last.row_hash, row)))

    rec = list(ledger_store.read(last.seq + 1))[0]
    assert rec.event == BlocksFreed(worker=worker, tier="device", blocks=blocks, bytes=num_bytes, reason=reason)
    assert ledger_store.verify().ok
    assert ledger_store.peek_raw(last.seq + 1)[6] == 1            # stored as written: v1

    buf = io.StringIO()
    ledger_store.export_jsonl(buf)
    line = buf.getvalue().splitlines()[-1]
    assert '"payload":' in line and '"schema_version":1' in line
    from residency.ledger import LedgerStore
    with LedgerStore.open("sqlite:///:memory:", create=True) as copy:
        assert import_jsonl(copy, io.StringIO(buf.getvalue())) == last.seq + 1
        assert list(copy.read_raw()) == list(ledger_store.read_raw())
        assert copy.verify().ok
