"""Restore or recompute a parked prefix: price the time each choice adds to this request. Pure.

    recompute  ─ prefill the cached tokens again:            cached_tokens / prefill_tokens_per_s
    restore    ─ copy the pages back, minus what hides        max(0, transfer_s - hidden_s) + fixed_s
                 behind the prefill of the new tokens:        hidden_s = min(new_tokens / prefill_tokens_per_s,
                                                                             link_s)
                                                                (0 when the worker cannot overlap, when
                                                                 the pages come from two tiers, or when
                                                                 a figure it needs is not measured yet)
    transfer_s = Σ bytes_from_tier / bandwidth(tier→device)   (disk pages cross disk→host→device)
    link_s     = from the host: bytes / bandwidth(host)
                 from disk:     max(bytes / bandwidth(disk), bytes / bandwidth(host)): the slower link

A restore from disk crosses two links, and the worker reads the next band of layers while the
last one is copied: the prefill can hide behind the slower link's time, never behind both (the
faster link's part of ``transfer_s`` is always paid).

A transfer hidden behind compute is nearly free, so raw bytes are never the price: only the
unhidden remainder is. The same rule prices an offloaded MoE expert's fetch (``price_expert_fetch``:
a prefetch hides behind a layer, a fetch on demand behind nothing), and the experts' measured
copies (``ExpertsMoved``) teach the same host -> device bandwidth the restores do. Bandwidths and
prefill speed start from configured values and follow what the workers measure (``MoveAcked``
times, step durations less what they waited for landing pages) as an exponentially weighted
average. What hides is priced only from a measured prefill speed: until a worker has timed one, a
restore is priced as if nothing hid (the safe direction); the same holds for a restore from disk
until a disk restore has been timed (``num_transfers_measured``).
"""
from __future__ import annotations

import msgspec


class PrefixDecision(msgspec.Struct, frozen=True, kw_only=True):
    choice: str                       # "restore" | "recompute"
    restore_s: float
    recompute_s: float
    transfer_s: float
    hidden_s: float
    reason: str


class ExpertFetchPrice(msgspec.Struct, frozen=True, kw_only=True):
    """What fetching an offloaded MoE expert costs the step that needs it (fetch vs wait):

        fetch_s = bytes / bandwidth(host -> device)        the copy, at the measured bandwidth
        wait_s  = max(0, fetch_s - hidden_s)               what the layer waits for it
    hidden_s: compute the copy overlaps (a prefetch issued a layer ahead hides behind that layer;
    a fetch on demand hides behind nothing)."""

    fetch_s: float
    hidden_s: float
    wait_s: float


class CostModel:
    """Mutable only through ``observe_*`` (the measurements); ``decide`` is a pure function of them."""

    def __init__(self, *, host_to_device_bytes_per_s: float = 8e9, disk_to_host_bytes_per_s: float = 1e9,
                 prefill_tokens_per_s: float = 2000.0, fixed_restore_s: float = 0.002, overlap: bool = False,
                 smoothing: float = 0.3):
        self.bandwidth = {"host": float(host_to_device_bytes_per_s), "disk": float(disk_to_host_bytes_per_s)}
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.fixed_restore_s = float(fixed_restore_s)
        self.overlap = overlap
        self.smoothing = smoothing
        self.num_prefills_measured = 0   # steps that taught prefill_tokens_per_s (0: still the configured guess)
        # transfers that taught each link's bandwidth (0: still the configured guess)
        self.num_transfers_measured = {"host": 0, "disk": 0}

    # ------------------------------------------------------------------ decision
    def transfer_s(self, bytes_by_tier: dict[str, int]) -> float:
        t = 0.0
        for tier, n in bytes_by_tier.items():
            if n <= 0:
                continue
            if tier == "disk":                      # disk → host, then host → device
                t += n / self.bandwidth["disk"] + n / self.bandwidth["host"]
            else:
                t += n / self.bandwidth["host"]
        return t

    def hidden_s(self, new_tokens: int, bytes_by_tier: dict[str, int]) -> float:
        """What of a restore's copy hides behind the new tokens' prefill (see the module's doc): only
        for one move (pages from one tier), a worker that overlaps, and measured figures."""
        tiers = [(t, n) for t, n in bytes_by_tier.items() if n > 0]
        if not (self.overlap and self.num_prefills_measured and len(tiers) == 1):
            return 0.0
        tier, n = tiers[0]
        if tier == "disk":
            if not self.num_transfers_measured["disk"]:
                return 0.0
            link = max(n / self.bandwidth["disk"], n / self.bandwidth["host"])
        else:
            link = n / self.bandwidth["host"]
        return min(new_tokens / self.prefill_tokens_per_s, link)

    def decide(self, *, cached_tokens: int, new_tokens: int, bytes_by_tier: dict[str, int]) -> PrefixDecision:
        """Which choice adds less time to this request. Ties go to restore (no recompute work)."""
        transfer = self.transfer_s(bytes_by_tier)
        hidden = self.hidden_s(new_tokens, bytes_by_tier)
        restore = max(0.0, transfer - hidden) + self.fixed_restore_s
        recompute = cached_tokens / self.prefill_tokens_per_s
        choice = "restore" if restore <= recompute else "recompute"
        reason = (f"restore {restore * 1e3:.2f} ms (transfer {transfer * 1e3:.2f} - hidden {hidden * 1e3:.2f} "
                  f"+ fixed {self.fixed_restore_s * 1e3:.2f}) vs recompute {recompute * 1e3:.2f} ms "
                  f"({cached_tokens} tokens at {self.prefill_tokens_per_s:.0f}/s)")
        return PrefixDecision(choice=choice, restore_s=restore, recompute_s=recompute, transfer_s=transfer,
                              hidden_s=hidden, reason=reason)

    def price_expert_fetch(self, nbytes: int, hidden_s: float = 0.0) -> ExpertFetchPrice:
        """Fetch vs wait for ``nbytes`` of experts (see ``ExpertFetchPrice``). Pure."""
        fetch = max(0, nbytes) / self.bandwidth["host"]
        return ExpertFetchPrice(fetch_s=fetch, hidden_s=hidden_s, wait_s=max(0.0, fetch - hidden_s))

    # ------------------------------------------------------------------ what the workers can do
    def observe_overlap(self, can_overlap: list[bool]) -> None:
        """The serving workers' ``ServingReady.restore_overlap``: a restore is priced as hidden
        behind the new tokens' prefill only when every one of them starts that prefill while the
        pages land (a request may go to any of them); none known: not hidden."""
        self.overlap = bool(can_overlap) and all(can_overlap)

    # ------------------------------------------------------------------ measurements
    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def observe_transfer(self, src: str, nbytes: int, seconds: float) -> None:
        """A restore (src → device) or promote (disk → host) the worker timed."""
        if nbytes <= 0 or seconds <= 0 or src not in self.bandwidth:
            return
        self.bandwidth[src] = self._ewma(self.bandwidth[src], nbytes / seconds)
        self.num_transfers_measured[src] += 1

    def observe_expert_moves(self, moves) -> None:
        """The copies of an ``ExpertsMoved`` (fetches and prefetches the worker timed): host -> device
        bytes over their summed measured time, one observation per step. Evictions copy nothing."""
        copies = [m for m in moves if m.kind != "evict" and m.ns]
        if copies:
            self.observe_transfer("host", sum(m.bytes for m in copies), sum(m.ns for m in copies) / 1e9)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled ``num_tokens`` prompt tokens in ``seconds``."""
        if num_tokens < 16 or seconds <= 0:        # decode-sized steps say little about prefill speed
            return
        self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, num_tokens / seconds)
        self.num_prefills_measured += 1
