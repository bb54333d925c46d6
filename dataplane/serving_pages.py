"""Pages a session's turn copies from another session's (prefix sharing, ``Generate.copy_from``).

The copies are made on the device, on the stream the model runs on, so the prefill that reads
them is ordered after. A donor page may still be landing in the restore the turn awaits
(``Generate.awaits_move``): it is not copied yet, since its bytes are neither in nor verified.
Until that restore is settled the turn's prefill reads the donor's landing slot in place of its
own copy (the prefill writes no cached page, so reading the source is reading the copy), and the
copy is made once the restore is verified (``copy_landed``); if it failed, the turn fails and its
pages, the copies' destinations among them, are freed once.

    copy_from:   [d0 resident][d1 landing][d2 landing]
    block_ids:   [c0         ][c1        ][c2        ][new ...]
    at start:     c0 <- d0     c1, c2 allocated; the prefill reads d1's, d2's landing slots
    settled ok:                c1 <- d1, c2 <- d2 (published now); the next step reads c1, c2
"""
from __future__ import annotations

from collections.abc import Sequence

from residency.dataplane.pools import DataPlaneError


def copy_slots(words, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy rows ``src[k]`` to ``dst[k]`` of ``words``: one copy per run of slots consecutive on both
    sides (the two sets are disjoint)."""
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        words[dst[i]:dst[i] + j - i].copy_(words[src[i]:src[i] + j - i])
        i = j


def take_copies(pool, src_blocks: Sequence[int], dst_blocks: Sequence[int], landing: dict[int, int] | None):
    """Allocate ``dst_blocks`` and copy into them the pages of ``src_blocks`` that are resident.
    ``landing``: source block -> the slot it is landing in (the awaited restore), or None.
    Returns (problem or None; the (source, destination) pairs still to copy once the restore is
    verified; destination -> the landing slot the prefill reads meanwhile). A problem: nothing
    allocated."""
    try:
        dst = pool.allocate(dst_blocks)
    except DataPlaneError as e:
        return f"no room for the copied pages: {e}", [], {}
    landing = landing or {}
    now = [(s, d) for s, d in zip(src_blocks, dst) if s not in landing or pool.has(s)]
    later = [(s, b) for s, b in zip(src_blocks, dst_blocks) if s in landing and not pool.has(s)]
    copy_slots(pool.words, pool.slots_of([s for s, _ in now]), [d for _, d in now])
    return None, later, {b: landing[s] for s, b in later}


def copy_landed(pool, later: Sequence[tuple[int, int]]) -> None:
    """The copies ``take_copies`` left for after the restore: its pages are published and verified now."""
    if later:
        copy_slots(pool.words, pool.slots_of([s for s, _ in later]), pool.slots_of([b for _, b in later]))


__all__ = ["copy_landed", "copy_slots", "take_copies"]
