"""Knobs of the policies (all times in seconds; converted to ns where compared)."""
from __future__ import annotations

import msgspec


class PolicyConfig(msgspec.Struct, kw_only=True):
    pressure: bool = True             # spill the device (and demote the host) above the high watermark
    high_watermark: float = 0.90      # of the tier's limit (ceiling, or capacity)
    low_watermark: float = 0.75       # spill until the tier is back here
    park: bool = True                 # park sessions idle for park_idle_s
    park_idle_s: float = 30.0
    hot_s: float = 2.0                # a block used this recently is never spilled by a policy
    cooldown_s: float = 10.0          # a block moved this recently is left where it is by policies
    max_blocks_per_move: int = 256    # one move, one batched copy; more blocks wait for the next tick
    refusal_backoff_s: float = 5.0    # a refused policy ask is not asked again unchanged before this

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(f"watermarks must satisfy 0 < low ({self.low_watermark}) <= high "
                             f"({self.high_watermark}) <= 1")
