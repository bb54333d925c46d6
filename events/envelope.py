"""The envelope every ledger row carries around its payload.

``seq`` is assigned by the ledger's single writer (gapless, commit order); producers leave it 0.
(producer, epoch, producer_seq) identifies an append for idempotence: a retried append of the
same triple never makes a second row.
"""
from __future__ import annotations

import msgspec


class Envelope(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    producer: str               # "control", "worker:0", "simulate", ...
    epoch: int                  # the producer's incarnation (bumped on every restart)
    producer_seq: int           # per (producer, epoch), starts at 1
    ts_ns: int                  # wall clock of the producer, ns since the Unix epoch
    correlation_id: str | None = None   # request or session the event belongs to
    causation: str | None = None        # the seq or move_id that caused it
    seq: int = 0                # assigned by the ledger; 0 = not yet appended


class Recorded(msgspec.Struct, frozen=True, gc=False):
    """An event as read back from the ledger: its envelope, the event, and the chain hash."""

    envelope: Envelope
    event: "object"             # an events.catalog.Event
    row_hash: bytes = b""

    @property
    def seq(self) -> int:
        return self.envelope.seq
