"""A proposal: one move that a policy wants, or that an operator's or the API's ask resolved to,
before the budget authority sees it. Pure.

A ``Proposal`` is one move on one worker: blocks, source, destination, whether the source copy
stays; ``origin`` says who wants it ("policy:pressure", "operator:park", "api:restore", ...).
A *release* (free copies on one tier, nothing copied) is a proposal with ``src == dst``. It is
requested as a move that copies nothing and keeps what it has,
``MoveRequested(kind="evict", src=T, dst=T, keep_source=True, reason="release:...")``, and answered
by its own fact, ``CopiesReleased`` with the bytes the worker measured
(``control.moves.settle_events``). Requesting it as a move keeps write-ahead for releases and
makes "a release whose worker never answered" a ``MoveStranded(why="silent_release")`` like any
other move.
"""
from __future__ import annotations

import msgspec

from residency.control.state import State

# Where each kind goes by default, and whether the source copy stays.
KIND_DEFAULTS: dict[str, tuple[str | None, str, bool]] = {
    "spill": ("device", "host", True),
    "evict": ("device", "host", False),
    "park": ("device", "host", False),
    "restore": (None, "device", False),      # None: from wherever the copy is (host before disk)
    "demote": ("host", "disk", False),
    "promote": ("disk", "host", True),
}
RESTORE_SOURCES = ("host", "disk")


class Proposal(msgspec.Struct, frozen=True, kw_only=True):
    origin: str                 # who wants it: "policy:pressure", "operator:park", "api:restore", ...
    kind: str
    worker: int
    src: str
    dst: str
    blocks: tuple[int, ...]
    keep_source: bool
    session: str | None = None
    reason: str = ""

    @property
    def is_release(self) -> bool:
        return self.src == self.dst


def release(origin: str, worker: int, tier: str, blocks, reason: str, session: str | None = None) -> Proposal:
    return Proposal(origin=origin, kind="evict", worker=worker, src=tier, dst=tier, blocks=tuple(blocks),
                    keep_source=True, session=session, reason=f"release:{reason}")


def busy_blocks(state: State) -> dict[int, set[int]]:
    """Blocks named by a move in flight or stranded (not yet resolved), per worker: no policy
    or operator may move them until that move has its outcome."""
    busy: dict[int, set[int]] = {}
    for mv in state.inflight.values():
        busy.setdefault(mv.worker, set()).update(mv.blocks)
    for mv in state.stranded.values():
        busy.setdefault(mv.worker, set()).update(mv.blocks)
    return busy


def leaving_bytes(state: State) -> dict[tuple[int, str], int]:
    """Bytes that in-flight moves will free on their source tier once acked, per (worker, tier)."""
    out: dict[tuple[int, str], int] = {}
    for mv in state.inflight.values():
        if not mv.keep_source or mv.src == mv.dst:      # a move that frees its source, or a release
            key = (mv.worker, mv.src)
            out[key] = out.get(key, 0) + mv.bytes_planned
    return out


def split_for_destination(state: State, origin: str, kind: str, worker: int, src: str, dst: str,
                          blocks, keep_source: bool, session: str | None, reason: str) -> list[Proposal]:
    """A move of ``blocks`` src→dst where some may already have a copy on dst: those need no
    copy; if the source is to be freed they become a release of the source copy."""
    wb = state.blocks.get(worker, {})
    to_copy = [b for b in blocks if dst not in wb[b].tiers]
    already = [b for b in blocks if dst in wb[b].tiers]
    proposals = []
    if to_copy:
        proposals.append(Proposal(origin=origin, kind=kind, worker=worker, src=src, dst=dst,
                                  blocks=tuple(to_copy), keep_source=keep_source, session=session, reason=reason))
    if already and not keep_source:
        proposals.append(release(origin, worker, src, already, f"{kind} (copy already on {dst})", session))
    return proposals
