"""Knobs of the serving scheduler (times in seconds)."""
from __future__ import annotations

import msgspec

RESTORE_POLICIES = ("cost", "restore", "recompute")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    page_tokens: int
    max_context: int
    park_after_s: float = 2.0          # an idle session's pages leave the device after this long
    restore_policy: str = "cost"       # cost | restore (always) | recompute (never restore)
    max_waiting: int = 256             # admitted requests waiting for room; beyond this: refused
    wait_timeout_s: float = 120.0      # a request that waited this long for room is refused
    share_prefixes: bool = True        # a prompt may start from another session's resident pages

    def __post_init__(self) -> None:
        if self.page_tokens <= 0 or self.max_context <= 0:
            raise ValueError(f"page_tokens {self.page_tokens} and max_context {self.max_context} must be > 0")
        if self.restore_policy not in RESTORE_POLICIES:
            raise ValueError(f"restore_policy {self.restore_policy!r} is not one of {RESTORE_POLICIES}")
        if self.park_after_s < 0:
            raise ValueError(f"park_after_s {self.park_after_s} must be >= 0")
