"""Messages between the control process and data-plane workers (never stored as events).

Commands are imperative (``ExecuteMove``); replies are past tense or nouns. A worker answers a
move with one of the catalog's outcome events (``MoveAcked``, ``MoveFailed``, ``MoveRejected``),
so what the worker measured is exactly what the ledger records.
"""
from __future__ import annotations

from typing import Union

import msgspec

from events.catalog import MoveAcked, MoveFailed, MoveKind, MoveRejected, Tier


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True, gc=False):
    pass


# ---------------------------------------------------------------- control -> worker
class ExecuteMove(Message):
    move_id: str
    kind: MoveKind
    src: Tier
    dst: Tier
    blocks: list[int]
    keep_source: bool
    deadline_ns: int
    session: str | None = None


class CommitBlocks(Message):
    """Fill new blocks on a tier (the model's prefill does this; tests use seeded random bytes)."""

    request_id: str
    session: str | None
    tier: Tier
    blocks: list[int]
    seed: int


class ReleaseBlocks(Message):
    release_id: str
    tier: Tier
    blocks: list[int]


class QueryMoves(Message):
    """After a control restart: which of these moves did you complete, and how?"""

    move_ids: list[str]


class Ping(Message):
    nonce: int
    ts_ns: int


class Shutdown(Message):
    reason: str


# ---------------------------------------------------------------- worker -> control
class Hello(Message):
    worker: int
    epoch: int
    device: str
    tiers: dict[str, int]
    block_bytes: int


class Pong(Message):
    worker: int
    nonce: int
    ts_ns: int


class BlocksWritten(Message):
    request_id: str
    worker: int
    tier: Tier
    blocks: list[int]
    bytes: int
    keys: list[str]


class BlocksReleased(Message):
    release_id: str
    worker: int
    tier: Tier
    blocks: list[int]
    bytes_freed: int                  # measured by the pool; 0 is an accounting, silence is not


class MovesReport(Message):
    worker: int
    outcomes: list[Union[MoveAcked, MoveFailed, MoveRejected]]
    unknown: list[str]                # move_ids the worker never saw


class ErrorReply(Message):
    """A named error for a message that could not be decoded or handled."""

    error: str
    detail: str


AnyCommand = Union[ExecuteMove, CommitBlocks, ReleaseBlocks, QueryMoves, Ping, Shutdown]
AnyReply = Union[
    Hello, Pong, BlocksWritten, BlocksReleased, MovesReport, ErrorReply,
    MoveAcked, MoveFailed, MoveRejected,
]
AnyMessage = Union[
    ExecuteMove, CommitBlocks, ReleaseBlocks, QueryMoves, Ping, Shutdown,
    Hello, Pong, BlocksWritten, BlocksReleased, MovesReport, ErrorReply,
    MoveAcked, MoveFailed, MoveRejected,
]

__all__ = [
    "Message", "ExecuteMove", "CommitBlocks", "ReleaseBlocks", "QueryMoves", "Ping", "Shutdown",
    "Hello", "Pong", "BlocksWritten", "BlocksReleased", "MovesReport", "ErrorReply",
    "AnyCommand", "AnyReply", "AnyMessage",
]
