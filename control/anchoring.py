"""The server's side of the ledger's anchors: the head it committed, appended to an anchor file
every ``every_events`` committed events and once at stop (ledger.anchor says why and how an
operator checks them). The head is the one this process chained itself (``LedgerStore.head``),
not one read back from a database someone else may be writing."""
from __future__ import annotations

import structlog

from residency.ledger import anchor

log = structlog.get_logger("control.anchoring")


class Anchoring:
    def __init__(self, store, path: str, key_path: str | None, every_events: int, last_seq: int):
        if every_events <= 0:
            raise ValueError(f"anchor_every_events must be positive, got {every_events}")
        self.store = store
        self.path = path
        self.key = anchor.load_key(key_path) if key_path else None    # read once: a bad key fails the start
        self.every_events = every_events
        self.anchored_seq = last_seq          # nothing new to anchor until this many more commit

    def committed(self, committed: int) -> None:
        """Append the head once ``every_events`` more events have committed since the last."""
        if committed - self.anchored_seq >= self.every_events:
            self.write()

    def write(self) -> None:
        seq, digest = self.store.head()
        if seq == 0 or seq == self.anchored_seq:
            return
        anchor.append(self.path, seq, digest, self.key)
        self.anchored_seq = seq
        log.info("ledger_anchored", seq=seq, row_hash=digest.hex(), path=self.path)
