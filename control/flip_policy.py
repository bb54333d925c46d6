"""When a request for a model that is not resident flips a worker to it. Pure.

A flip stops a worker's model for as long as its bytes take to cross the link, so it must buy
more than it costs, and two models wanted at once must not make the arena swing between them
(each swing pays both ways and serves nothing meanwhile):

    nothing waits for another model                      -> stay
    the resident model has requests in hand (running or  -> stay while it has been resident less
    waiting), and it became resident recently               than ``min_residency_s`` (hysteresis)
    the resident model has requests in hand              -> flip once the oldest request waiting
                                                            for the other model has waited longer
                                                            than the flip costs (bytes / bandwidth),
                                                            and more wait for it than for the resident
    the resident model has nothing in hand               -> flip now (an idle arena costs nobody)

Of the models waiting, the one with the most requests waiting goes in (the longest wait on a tie,
then the name). The flip's cost comes from measured flips (bytes both ways over their wall time);
until one is measured, ``assumed_bytes_per_s`` stands in, and the reason says so.
"""
from __future__ import annotations

import msgspec

S = 1_000_000_000


class FlipPolicyConfig(msgspec.Struct, frozen=True, kw_only=True):
    min_residency_s: float = 5.0
    assumed_bytes_per_s: float = 1.0e9    # a flip's bandwidth until one has been measured


class Backlog(msgspec.Struct, frozen=True, kw_only=True):
    """Requests in hand for one model on one worker's behalf."""

    model: str
    waiting: int                      # requests held for it (not yet tokenized)
    oldest_wait_ns: int = 0           # when the oldest of them began waiting (0: none)


class FlipDecision(msgspec.Struct, frozen=True, kw_only=True):
    flip: bool
    to_model: str                     # "" when it stays
    reason: str
    cost_s: float = 0.0               # the flip's expected time


def flip_cost_s(bytes_out: int, bytes_in: int, measured_bytes_per_s: float | None, cfg: FlipPolicyConfig) -> float:
    bw = measured_bytes_per_s if measured_bytes_per_s else cfg.assumed_bytes_per_s
    return (bytes_out + bytes_in) / bw


def decide(now_ns: int, resident: str, resident_since_ns: int, in_hand_resident: int, others: list[Backlog],
           image_bytes: dict[str, int], measured_bytes_per_s: float | None,
           cfg: FlipPolicyConfig = FlipPolicyConfig()) -> FlipDecision:
    """Whether a worker serving ``resident`` (since ``resident_since_ns``, with
    ``in_hand_resident`` requests of it running or waiting) flips to one of ``others``."""
    waiting = [b for b in others if b.waiting > 0 and b.model != resident]
    if not waiting:
        return FlipDecision(flip=False, to_model="", reason="no request waits for another model")
    best = min(waiting, key=lambda b: (-b.waiting, b.oldest_wait_ns or now_ns, b.model))
    cost = flip_cost_s(image_bytes.get(resident, 0), image_bytes.get(best.model, 0), measured_bytes_per_s, cfg)
    how = (f"{image_bytes.get(resident, 0) + image_bytes.get(best.model, 0)} bytes at "
           + (f"{measured_bytes_per_s:.3g} B/s measured" if measured_bytes_per_s
              else f"{cfg.assumed_bytes_per_s:.3g} B/s assumed (no flip measured yet)"))
    if in_hand_resident == 0:
        return FlipDecision(flip=True, to_model=best.model, cost_s=cost,
                            reason=f"{resident!r} has no request in hand; {best.waiting} wait for {best.model!r} "
                                   f"(flip ~{cost:.3g} s: {how})")
    held_s = (now_ns - resident_since_ns) / S
    if held_s < cfg.min_residency_s:
        return FlipDecision(flip=False, to_model="", cost_s=cost,
                            reason=f"{resident!r} resident {held_s:.3g} s < minimum {cfg.min_residency_s:g} s with "
                                   f"{in_hand_resident} request(s) in hand")
    waited_s = (now_ns - best.oldest_wait_ns) / S if best.oldest_wait_ns else 0.0
    if best.waiting <= in_hand_resident:
        return FlipDecision(flip=False, to_model="", cost_s=cost,
                            reason=f"{best.waiting} wait for {best.model!r}, no more than the {in_hand_resident} "
                                   f"{resident!r} has in hand")
    if waited_s <= cost:
        return FlipDecision(flip=False, to_model="", cost_s=cost,
                            reason=f"the oldest request for {best.model!r} waited {waited_s:.3g} s, not yet the "
                                   f"flip's cost ~{cost:.3g} s ({how})")
    return FlipDecision(flip=True, to_model=best.model, cost_s=cost,
                        reason=f"{best.waiting} wait for {best.model!r} (> {in_hand_resident} in hand for "
                               f"{resident!r}), the oldest {waited_s:.3g} s > the flip's cost ~{cost:.3g} s ({how})")


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A worker the policy may flip: idle of any flip, awake, not stranded, with two models or more."""

    worker: int
    resident: str
    resident_since_ns: int
    in_hand: int                      # its requests running or waiting
    image_bytes: dict[str, int]       # its models -> their image bytes


def pick(now_ns: int, backlog: dict[str, list[int]], candidates: list[Candidate],
         measured_bytes_per_s: float | None, cfg: FlipPolicyConfig = FlipPolicyConfig()
         ) -> tuple[int, FlipDecision] | None:
    """The first worker (fewest requests in hand, then lowest id) that ``decide`` flips toward the
    models ``backlog`` holds requests for (model -> when each began to wait), or None."""
    others = [Backlog(model=m, waiting=len(v), oldest_wait_ns=min(v)) for m, v in backlog.items()]
    for c in sorted(candidates, key=lambda c: (c.in_hand, c.worker)):
        mine = [b for b in others if b.model in c.image_bytes]
        d = decide(now_ns, c.resident, c.resident_since_ns, c.in_hand, mine, c.image_bytes, measured_bytes_per_s,
                   cfg)
        if d.flip:
            return c.worker, d
    return None
