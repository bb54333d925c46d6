"""Prefixes retained for requests outside a session: which session such a request runs as. Pure.

A request outside a session used to free every page it wrote. With retention, the first request
of a prompt family (a system prompt nobody holds yet) runs as a session of its own, named
``~<request id>`` (a name no client can give: ``~`` is not in a session id's alphabet), and keeps
its pages like any session's turn: parked when idle, demoted under pressure, shared with later
prompts that open the same way (``sharing.py``), evicted by the book, least recently used first,
past the retention budget (the service). So:

    request 1: [sys][sys][q1 ]          no donor           -> runs as ~r1, kept
    request 2: [sys][sys][q2 ]          ~r1 shares 2 pages -> read in place, nothing kept
    request 3: [sys][sys][q1 ][a1][q3]  ~r1's pages all match, ~r1 idle -> continues ~r1

Nothing is kept twice: a request some session already shares pages with is not retained.
"""
from __future__ import annotations

from collections.abc import Iterable

from residency.control.scheduler.prefix import num_matching_pages
from residency.control.scheduler.sessions import SessionEntry
from residency.control.scheduler.sharing import find_shared_prefix
from residency.control.state import State

PREFIX = "~"


def is_retained(session: str | None) -> bool:
    return session is not None and session.startswith(PREFIX)


def retained_session_for(sessions: Iterable[SessionEntry], state: State, worker: int, *, request_id: str,
                         prompt_keys: list[str], prompt_tokens: int, page_tokens: int,
                         moving: set[int]) -> str | None:
    """The session a request outside a session runs as: an idle retained session whose every full
    page this prompt starts with (the longest), else a new one when no session shares any page
    with it, else None (it runs outside a session and frees what it writes)."""
    sessions = list(sessions)
    reusable = num_matching_pages(prompt_keys, prompt_keys, prompt_tokens, page_tokens)
    if reusable == 0:
        return None
    best, best_n = None, 0
    for e in sessions:
        if not is_retained(e.session) or e.busy is not None or e.worker != worker:
            continue
        full = next((i for i, k in enumerate(e.keys) if not k), len(e.keys))
        if full and full > best_n and num_matching_pages(e.keys[:full], prompt_keys, prompt_tokens,
                                                         page_tokens) == full:
            best, best_n = e.session, full
    if best is not None:
        return best
    _, shared = find_shared_prefix(sessions, state, worker, exclude=None, prompt_keys=prompt_keys,
                                   prompt_tokens=prompt_tokens, page_tokens=page_tokens, moving=moving)
    return None if shared else PREFIX + request_id


def retained_bytes(entry: SessionEntry, state: State, block_bytes: int) -> int:
    """Bytes a retained session holds, every copy on every tier counted."""
    wb = state.blocks.get(entry.worker, {})
    return sum(len(wb[b].tiers) for b in entry.blocks if b in wb) * block_bytes
