"""Which experts of an offloaded MoE layer sit in its device slots. Pure: lists and numbers in, choices out.

A worker serving with ``--expert-budget`` keeps every expert in pinned host memory and gives each
layer ``S`` device slots (``slots_for_budget``). A step's routing names the experts it needs
(``hit``); the runtime (dataplane/model/experts.py) asks here:

    plan_passes(hit, S)                 the hit experts in passes of at most S, ascending ids
    choose_victims(resident, keep, …)   which resident experts give up their slots to missing ones
    choose_prefetch(resident, …)        which hot experts of the next layer to copy in ahead

and both choices follow ``RoutingFrequency``: the routing the worker measured, decayed per step,
so experts the traffic keeps choosing stay on the device and the ones it stopped choosing leave.

    budget 50% of 16 layers × 64 experts × 12 MiB (OLMoE-1B-7B, bf16) = 6 GiB  ->  S = 32 slots a layer
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from residency.dataplane.model.errors import ModelError

# How much of an expert's measured frequency survives each new observation of its layer:
# about the last 1/(1 - DECAY) = 20 steps count.
DECAY = 0.95
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


class ExpertBudgetRefused(ModelError):
    """An expert budget that cannot be served, with its arithmetic."""


@dataclass(frozen=True)
class ExpertBudget:
    """``--expert-budget``: a fraction of the model's expert bytes, or a number of bytes."""

    fraction: float | None = None
    bytes: int | None = None

    def resolve(self, total_bytes: int) -> int:
        return int(self.fraction * total_bytes) if self.fraction is not None else int(self.bytes)

    def __str__(self) -> str:
        return f"{self.fraction:.0%}" if self.fraction is not None else f"{self.bytes} bytes"


def parse_expert_budget(text: str) -> ExpertBudget:
    """``"50%"``, ``"0.5"`` (a fraction in (0, 1], written with its point), ``"6GiB"``, ``"6e9"`` or
    ``"6442450944"`` (bytes: ``"1"`` is one byte, not 100%)."""
    t = text.strip().lower().replace(" ", "")
    try:
        if t.endswith("%"):
            f = float(t[:-1]) / 100
        elif re.fullmatch(r"0?\.\d+|1\.0*", t):       # a fraction has its point: a bare integer is bytes
            f = float(t)
        else:
            m = re.fullmatch(r"([0-9.e+]+)([a-z]*)", t)
            if m is None or m.group(2) not in _UNITS:
                raise ValueError(text)
            n = int(float(m.group(1)) * _UNITS[m.group(2)])
            if n <= 0:
                raise ValueError(text)
            return ExpertBudget(bytes=n)
    except ValueError:
        raise ExpertBudgetRefused(f"expert budget {text!r}: want a percentage (50%), a fraction (0.5) "
                                  "or bytes (6GiB, 6442450944)") from None
    if not 0 < f <= 1:
        raise ExpertBudgetRefused(f"expert budget {text!r}: a fraction must lie in (0, 1], got {f}")
    return ExpertBudget(fraction=f)


def slots_for_budget(budget: ExpertBudget, *, num_layers: int, num_experts: int, expert_bytes: int) -> int:
    """Device slots per layer the budget buys: every layer gets the same number (each step visits
    every layer). Refuses a budget that buys no slot, naming the numbers."""
    total = num_layers * num_experts * expert_bytes
    budget_bytes = budget.resolve(total)
    slots = min(num_experts, budget_bytes // (num_layers * expert_bytes))
    if slots < 1:
        raise ExpertBudgetRefused(
            f"expert budget {budget} = {budget_bytes} bytes buys no device slot: one expert in each of "
            f"{num_layers} layers takes {num_layers * expert_bytes} bytes ({expert_bytes} an expert; "
            f"all {num_layers}x{num_experts} experts take {total})")
    return int(slots)


class RoutingFrequency:
    """Per layer and expert: how often the traffic routed to it lately, as measured.

    ``observe(layer, counts)`` after each step's routing of that layer (counts[e]: the (token,
    choice) pairs routed to e): freq = DECAY · freq + counts. Never guessed: an expert no step has
    routed to has frequency 0."""

    def __init__(self, num_layers: int, num_experts: int, decay: float = DECAY):
        self.decay = decay
        self.freq = [[0.0] * num_experts for _ in range(num_layers)]

    def observe(self, layer: int, counts: Sequence[int]) -> None:
        f, d = self.freq[layer], self.decay
        for e, c in enumerate(counts):
            f[e] = f[e] * d + c

    def of(self, layer: int) -> list[float]:
        return self.freq[layer]


def plan_passes(hit: Sequence[int], num_slots: int) -> list[list[int]]:
    """The hit experts (ascending) in runs of at most ``num_slots``: one pass when they fit.

    NOTE: consecutive ascending runs, not a packing by residency: the reference path adds each
    expert's rows into the output in ascending id order, and float addition must keep that order
    for offloaded output to equal the all-resident model's bit for bit."""
    hit = sorted(hit)
    return [hit[i:i + num_slots] for i in range(0, len(hit), num_slots)] if hit else []


def choose_victims(resident: Mapping[int, int], keep: set[int], freq: Sequence[float], need: int) -> list[int]:
    """``need`` resident experts (expert -> slot) to evict, none of ``keep``: the coldest by
    measured frequency, ties to the higher id. Raises if fewer than ``need`` can go (the caller
    plans passes no larger than the slots, so this is a bug, not a budget)."""
    if need <= 0:
        return []
    candidates = sorted((e for e in resident if e not in keep), key=lambda e: (freq[e], -e))
    if len(candidates) < need:
        raise ExpertBudgetRefused(f"{need} slots needed, only {len(candidates)} resident experts may leave "
                                  f"({len(resident)} resident, {len(keep)} kept)")
    return candidates[:need]


def choose_prefetch(resident: Mapping[int, int], free_slots: int, freq: Sequence[float], cap: int
                    ) -> list[tuple[int, int | None]]:
    """Up to ``cap`` (expert, victim) pairs for the next layer: the hottest experts not resident,
    each into a free slot (victim None) or in place of a resident one strictly colder than it.
    Only measured frequency decides: an expert never routed to (frequency 0) is never prefetched."""
    wanted = sorted((e for e in range(len(freq)) if e not in resident and freq[e] > 0),
                    key=lambda e: (-freq[e], e))
    coldest = sorted(resident, key=lambda e: (freq[e], -e))
    out: list[tuple[int, int | None]] = []
    for e in wanted:
        if len(out) >= cap:
            break
        if free_slots > 0:
            free_slots -= 1
            out.append((e, None))
        elif coldest and freq[coldest[0]] < freq[e]:
            out.append((e, coldest.pop(0)))
        else:
            break      # the rest are no hotter than what stays
    return out


__all__ = ["DECAY", "ExpertBudget", "ExpertBudgetRefused", "RoutingFrequency", "parse_expert_budget",
           "slots_for_budget", "plan_passes", "choose_victims", "choose_prefetch"]
