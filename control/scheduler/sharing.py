"""Prefix sharing across sessions: which other session's resident pages already hold a prompt's
first pages. Pure.

Content keys are chained (``dataplane.model.prefix``), so equal keys at page i mean equal tokens
in pages 0..i: a new conversation that opens with the system prompt and few-shot examples another
session already computed needs none of those pages prefilled.

    session A (idle or running):  [k0][k1][k2][k3][a4]          pages on the device, verified
    new request's prompt:         [k0][k1][k2][b3][..]
                                   └ shared ─┘ └ computed ┘

Pages in no move are offered while the donor lists them: on the device and verified, or with a
host or disk copy that the scheduler prices like a session's own parked prefix (restored to the
device, still the donor's, or recomputed). A request outside a session reads them in place (held
for its run, never owned); a session's turn copies them into its own pages
(``Generate.copy_from``), so no session ever lists a page another owns. What the request read or
copied is in its ``RequestAdmitted``.
"""
from __future__ import annotations

from collections.abc import Iterable

from residency.control.scheduler.prefix import num_matching_pages
from residency.control.scheduler.sessions import SessionEntry, restore_plan
from residency.control.state import State


def find_shared_prefix(sessions: Iterable[SessionEntry], state: State, worker: int, *, exclude: str | None,
                       prompt_keys: list[str], prompt_tokens: int, page_tokens: int,
                       moving: set[int]) -> tuple[str | None, list[int]]:
    """(donor session, its pages holding the prompt's longest shareable prefix), or (None, []):
    the longest, then the one with the fewest pages off the device."""
    if not prompt_keys:
        return None, []
    first = prompt_keys[0]
    wb = state.blocks.get(worker, {})
    best: tuple[str | None, list[int]] = (None, [])
    best_score = (0, 0)
    for e in sessions:
        if e.worker != worker or e.session == exclude or not e.keys or e.keys[0] != first:
            continue
        n = min(num_matching_pages(e.keys, prompt_keys, prompt_tokens, page_tokens), len(e.blocks))
        k = 0
        while k < n and e.blocks[k] in wb and e.blocks[k] not in moving:
            k += 1
        usable, restore = restore_plan(wb, e.blocks[:k])
        score = (len(usable), -sum(len(bl) for bl in restore.values()))
        if score > best_score:
            best, best_score = (e.session, usable), score
    return best
