"""What a detector says: a ``Finding`` with the seqs that prove it and one line of advice.

A finding covers an interval: ``onset_ns`` is when the pattern began, ``until_ns`` when it ended,
``None`` while it persists at the point diagnosed. An episode that ended is still reported, with
its duration: an operator asking "why was the server slow at 14:02" needs the episodes that are over.
"""
from __future__ import annotations

from typing import Literal

import msgspec

Severity = Literal["critical", "warning", "info"]
SEVERITY_RANK: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}

# A finding's proof is a list of seqs; a pattern seen a million times is proved by a sample of them.
MAX_PROOF_SEQS = 32


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    detector: str                     # "overdue_move", "stall", ...
    severity: Severity
    title: str                        # one line, with the numbers
    seqs: list[int]                   # ledger rows that prove it (first ones, capped)
    subject: str                      # what it is about: "move m-17", "worker 1", "group workers"
    onset_ns: int
    until_ns: int | None              # None: still true at the point diagnosed
    suggestion: str
    detail: dict[str, int | str | float | list[str] | list[int] | None] = {}

    def duration_ns(self, at_ns: int) -> int:
        """How long the pattern lasted, or has lasted so far at ``at_ns`` when it persists."""
        return (self.until_ns if self.until_ns is not None else at_ns) - self.onset_ns


def proof(seqs: list[int] | tuple[int, ...], key: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Sorted, unique, capped. The ``key`` rows (the move, the last progress, the recovery edge)
    always stay; of the others, the first ones stay: they show how it started."""
    keep = set(key)
    rest = sorted(set(seqs) - keep)
    return sorted(keep | set(rest[: max(0, MAX_PROOF_SEQS - len(keep))]))


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; within a severity, in the order they began."""
    return sorted(findings, key=lambda f: (SEVERITY_RANK[f.severity], f.onset_ns, f.detector, f.subject))


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unmeasured"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n} B"


def fmt_duration(ns: int) -> str:
    s = ns / 1e9
    if s < 1:
        return f"{ns / 1e6:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
