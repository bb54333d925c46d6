"""Token log-probabilities in OpenAI's two wire shapes.

The worker reports, per generated token, its log-probability under the model's raw distribution
(before temperature and top_p), its text and exact bytes, and the ``k`` likeliest alternatives
(``events.commands.TokenLogprobs``). Chat completions list them per token:

    "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

legacy completions as parallel lists, with each token's character offset in the completion:

    "logprobs": {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}

A log-probability that is not finite (a model that produced NaN) is reported as -9999.0, as
OpenAI reports the unlikely, so the body stays valid JSON.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from residency.events.commands import TokenChoice, TokenLogprobs

FLOOR = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _chat_choice(c: TokenChoice) -> dict:
    return {"token": c.text, "logprob": _finite(c.logprob), "bytes": list(c.token_bytes)}


def chat_logprobs(lps: Sequence[TokenLogprobs]) -> dict:
    return {"content": [{**_chat_choice(t.chosen), "top_logprobs": [_chat_choice(c) for c in t.top]} for t in lps],
            "refusal": None}


class CompletionLogprobs:
    """The legacy shape for one completion, streamed in pieces: offsets continue across calls."""

    def __init__(self) -> None:
        self.offset = 0

    def render(self, lps: Sequence[TokenLogprobs]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in lps:
            out["tokens"].append(t.chosen.text)
            out["token_logprobs"].append(_finite(t.chosen.logprob))
            out["top_logprobs"].append({c.text: _finite(c.logprob) for c in t.top})
            out["text_offset"].append(self.offset)
            self.offset += len(t.chosen.text)
        return out
