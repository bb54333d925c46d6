"""Turning logits into tokens: greedy, temperature, top-p, per-request seeds, stop conditions."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0             # 0 = greedy (argmax; ties go to the lowest id)
    top_p: float = 1.0                   # nucleus: smallest set of tokens whose mass reaches top_p
    seed: int | None = None              # per-request generator; None draws a seed
    max_tokens: int = 128
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# Temperatures below this sample as greedy: dividing logits by a temperature near 0 overflows to
# inf, and softmax over infs is NaN, which no sampler can draw from. At 1e-5 a gap of 1e-3 between
# the two best logits already gives the best one all but e^-100 of the mass: argmax in all but name.
GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator: its samples do not depend on what else runs (None when greedy)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` [B, vocab] (float32)."""
    out = [0] * logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids = logits[greedy].argmax(dim=-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    probs = torch.softmax(row.float() / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p           # mass strictly before each token
        sorted_p = torch.where(before < p.top_p, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        # NOTE: logits that are themselves inf or NaN leave nothing to draw from; the best token is
        # the one answer that still follows the request's intent (and never raises mid-step).
        return int(row.argmax())
    if gen is not None and gen.device != probs.device:
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[int]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of ``logits`` [B, vocab]: the log-probability of ``tokens[i]`` under the model's
    own distribution (log-softmax of the raw logits: before temperature and top_p) and the
    ``ks[i]`` likeliest ids with theirs, likeliest first (ties: lowest id first)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(tokens), device=logp.device).view(-1, 1)).view(-1).tolist()
    k = max(ks, default=0)
    top_lp, top_id = ([], [])
    if k > 0:
        # a stable descending sort: equal log-probabilities keep the lower id first
        lp_sorted, id_sorted = logp.sort(dim=-1, descending=True, stable=True)
        top_lp, top_id = lp_sorted[:, :k].tolist(), id_sorted[:, :k].tolist()
    return [(chosen[i], list(zip(top_id[i][:ks[i]], top_lp[i][:ks[i]])) if ks[i] else [])
            for i in range(len(tokens))]


def stop_reason(token: int, num_generated: int, params: SamplingParams, eos_ids: set[int]) -> str | None:
    """"stop" at an eos or stop id, "length" at max_tokens, else None."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
