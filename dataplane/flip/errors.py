"""What the flip code raises; every class derives from the data plane's root ``DataPlaneError``.

A refusal carries its numbers as attributes and in its message, and is raised before a byte moves.
"""
from __future__ import annotations

from residency.dataplane.pools.errors import DataPlaneError


class FlipRefused(DataPlaneError):
    """A flip (or a load) that cannot run as asked; nothing moved. ``asked_bytes`` is what it would
    need of the named resource and ``available_bytes`` what there is; ``terms`` spells the sum."""

    def __init__(self, reason: str, asked_bytes: int, available_bytes: int, terms: dict[str, int] | None = None):
        self.reason = reason
        self.asked_bytes = int(asked_bytes)
        self.available_bytes = int(available_bytes)
        self.terms = dict(terms or {})
        shown = " + ".join(f"{k} {v}" for k, v in self.terms.items())
        super().__init__(f"flip refused ({reason}): asked {self.asked_bytes} bytes"
                         + (f" = {shown}" if shown else "") + f", available {self.available_bytes} bytes")


class ReaderRefused(DataPlaneError):
    """One or more readers refused a manifest (``refusals``: reader -> why); no reader was rebound."""

    def __init__(self, gen: int, refusals: dict[str, str]):
        self.gen = gen
        self.refusals = dict(refusals)
        shown = "; ".join(f"{r}: {why}" for r, why in self.refusals.items())
        super().__init__(f"rebind to generation {gen} refused by {len(self.refusals)} reader(s): {shown}")
