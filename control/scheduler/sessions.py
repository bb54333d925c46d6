"""What the scheduler remembers about a session beyond the ledger: page order and content keys.

Where each page *is* (device, host, disk, in flight) is never kept here: it is read from the
folded state, which only changes on acked bytes. This table only says which pages make up the
conversation so far, in order, and what they hold, so the next turn can find its prefix.
"""
from __future__ import annotations

import msgspec

from residency.control.policy.proposals import RESTORE_SOURCES
from residency.control.state import State


class SessionEntry(msgspec.Struct, kw_only=True):
    session: str
    worker: int
    blocks: list[int] = []          # the conversation's pages, in sequence order
    keys: list[str] = []            # content key per page ("" for the partial tail)
    num_tokens: int = 0             # positions whose KV those pages hold
    busy: str | None = None         # the request running on this session
    last_used_ns: int = 0

    def present_prefix(self, state: State) -> int:
        """How many leading pages still exist somewhere (a lost worker or a free cuts the chain)."""
        wb = state.blocks.get(self.worker, {})
        n = 0
        while n < len(self.blocks) and self.blocks[n] in wb:
            n += 1
        return n

    def truncate(self, num_pages: int, page_tokens: int) -> None:
        if num_pages < len(self.blocks):
            del self.blocks[num_pages:]
            del self.keys[num_pages:]
            self.num_tokens = min(self.num_tokens, num_pages * page_tokens)


def tier_of(state: State, worker: int, blocks: list[int]) -> str | None:
    """The slowest tier some page of ``blocks`` lives on: device if all are on the device, else
    host if none is only on disk, else disk. None for no pages."""
    if not blocks:
        return None
    wb = state.blocks.get(worker, {})
    worst = "device"
    for b in blocks:
        st = wb.get(b)
        if st is None:
            continue
        if "device" in st.tiers and st.device_verified:
            continue
        if "host" in st.tiers:
            worst = "host" if worst == "device" else worst
        else:
            worst = "disk"
    return worst


def restore_plan(wb: dict, pages: list[int]) -> tuple[list[int], dict[str, list[int]]]:
    """The leading ``pages`` (all in ``wb``) usable as a prefix (resident and verified, or with a
    host or disk copy to restore) and the restores they need, by source tier."""
    restore: dict[str, list[int]] = {}
    for i, b in enumerate(pages):
        st = wb[b]
        if "device" in st.tiers and st.device_verified:
            continue
        src = next((t for t in RESTORE_SOURCES if t in st.tiers), None)
        if src is None:                   # an unverified device copy and nothing else: unusable
            return pages[:i], restore
        restore.setdefault(src, []).append(b)
    return list(pages), restore
