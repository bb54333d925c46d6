"""Turning logits into tokens: penalties and logit_bias, greedy, temperature, top-p, per-request
seeds, stop conditions."""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from residency.dataplane.model.penalties import History, apply_penalties
from residency.events.serving import MAX_LOGIT_BIAS, MAX_PENALTY


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0             # 0 = greedy (argmax; ties go to the lowest id)
    top_p: float = 1.0                   # nucleus: smallest set of tokens whose mass reaches top_p
    seed: int | None = None              # per-request generator; None draws a seed
    max_tokens: int = 128
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    # dataplane/model/penalties.py; the defaults ask for none
    presence_penalty: float = 0.0        # once per token the completion generated
    frequency_penalty: float = 0.0       # per time the completion generated it
    repetition_penalty: float = 1.0      # CTRL's rule over prompt + completion
    logit_bias: Mapping[int, float] = field(default_factory=dict)   # token id -> added to its logit

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:        # NaN fails too
                raise ValueError(f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {v}")
        if not (0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {t} must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {b}")

    @classmethod
    def of(cls, wire, max_tokens: int, vocab_size: int) -> SamplingParams:
        """A worker's parameters from a Generate's (``events.serving.SamplingParams``). ValueError
        names what is out of range, a logit_bias id outside the model's ``vocab_size`` included."""
        outside = sorted(t for t in wire.logit_bias if not 0 <= t < vocab_size)
        if outside:
            raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
        return cls(temperature=wire.temperature, top_p=wire.top_p, seed=wire.seed, max_tokens=max_tokens,
                   ignore_eos=wire.ignore_eos, presence_penalty=wire.presence_penalty,
                   frequency_penalty=wire.frequency_penalty, repetition_penalty=wire.repetition_penalty,
                   logit_bias=dict(wire.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits before they are sampled."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


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
           generators: Sequence[torch.Generator | None], histories: Sequence[History] | None = None) -> list[int]:
    """One token per row of ``logits`` [B, vocab] (float32). ``histories[i]``: row i's tokens so far
    (prompt, then generated) and its number of prompt tokens, which its penalties read; needed only
    when a row asks for a penalty (ValueError otherwise). ``logits`` itself is not written."""
    logits = apply_penalties(logits, params, histories)
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
