"""The control process's own errors (the root, and the one that stops the loop)."""
from __future__ import annotations


class ControlError(Exception):
    """Root of the control process's own errors."""


class LedgerDiverged(ControlError):
    """A committed seq differs from the one the live state folded: another writer touched the ledger."""
