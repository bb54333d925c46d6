"""Sampling penalties and logit_bias: the logits a sequence's own tokens push down (or a client's bias
moves), before temperature, top_p or greedy's argmax read them.

For each row that asks for any, in this order (vLLM's):

    x = logits + logit_bias                                   (bias[t] added at id t)
    x = x / r  where x > 0 and t was seen  |  x * r  where x <= 0 and t was seen    (repetition_penalty r)
    x = x - frequency_penalty * count(t) - presence_penalty * (count(t) > 0)

"seen" (the repetition rule of CTRL, as Hugging Face applies it) is over the prompt and the
completion's tokens; ``count`` (OpenAI's frequency and presence penalties) is over the tokens the
completion generated, not the prompt.

Every rule touches only the (row, id) pairs a history or a bias names, never the whole vocabulary:
the batch's histories become one flat tensor of ``row * vocab + id`` on the logits' device,
``torch.unique`` counts it, and one gather and one scatter (``index_add_``, ``index_put_``) apply a
rule. So past one float32 copy of the step's logits, its cost is O(tokens in the histories of the
rows that ask), the same on CPU and GPU, with no Python loop over the vocabulary. The step's logits
are never written: a captured graph's output buffer and the log-probabilities (the model's own
distribution) read them.
"""
from __future__ import annotations

import array
import itertools
from collections.abc import Sequence

import torch

# A row's tokens so far (prompt, then what it generated) and how many of them are the prompt.
History = tuple[Sequence[int], int]


def _pairs(seqs: list[Sequence[int]], rows: list[int], vocab: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ``rows[k] * vocab + id`` of every id in ``seqs[k]`` (flat indices into a
    [R, vocab] tensor), and how many times each occurs."""
    flat = list(itertools.chain.from_iterable(seqs))
    if not flat:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty
    # a list of ints through array's buffer: ~12x faster than torch.tensor(list) for a batch's
    # histories (tens of thousands of ids), which had been most of a penalized step's cost
    host = torch.frombuffer(array.array("q", flat), dtype=torch.long)
    lo, hi = (int(v) for v in torch.aminmax(host))
    if lo < 0 or hi >= vocab:
        # NOTE: checked here, on the host: an index out of range in a CUDA gather is a device-side
        # assert that ends the process, not an exception one sequence can be failed with
        raise ValueError(f"token id {hi if hi >= vocab else lo} in a sequence is outside the logits' {vocab} ids")
    ids = host.to(device=device, copy=True)      # owns its memory (the array goes with this frame)
    lengths = torch.tensor([len(q) for q in seqs], dtype=torch.long, device=device)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long, device=device), lengths)
    return torch.unique(row * vocab + ids, return_counts=True)


def _per_pair(values: dict[int, float], pairs: torch.Tensor, vocab: int, num_rows: int) -> torch.Tensor:
    """Each pair's row's value (``values``: row -> value; rows not named: 0)."""
    per_row = [0.0] * num_rows
    for row, v in values.items():
        per_row[row] = v
    return torch.tensor(per_row, dtype=torch.float32, device=pairs.device)[pairs // vocab]


def apply_penalties(logits: torch.Tensor, params: Sequence, histories: Sequence[History] | None) -> torch.Tensor:
    """``logits`` [B, vocab] with each row's penalties and bias applied (``params[i]``: the
    dataplane's SamplingParams). Returns ``logits`` itself when no row asks for any, else a new
    float32 tensor; ``logits`` is never written. ValueError when a row asks for penalties and no
    history is given, or an id (a bias's, a history's) is outside the vocabulary."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling parameters for {logits.shape[0]} rows of logits")
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    vocab, dev = logits.shape[1], logits.device
    # one float32 copy of the whole step's logits, written in place at the rows that ask (their
    # indices below are the batch's own), never a copy of those rows and a second one to put back
    x = logits.to(torch.float32, copy=True).contiguous()
    ps = [params[i] for i in rows]

    bias = [(j, t, b) for j, p in enumerate(ps) for t, b in p.logit_bias.items()]
    if bias:
        js, ts, bs = zip(*bias)
        js = [rows[j] for j in js]
        out_of_range = [t for t in ts if not 0 <= t < vocab]
        if out_of_range:
            raise ValueError(f"logit_bias token id {out_of_range[0]} is outside the vocabulary [0, {vocab})")
        x.index_put_((torch.tensor(js, device=dev), torch.tensor(ts, device=dev)),
                     torch.tensor(bs, dtype=torch.float32, device=dev), accumulate=True)

    wants_history = any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in ps)
    if wants_history and (histories is None or len(histories) != len(params)):
        raise ValueError(f"penalties need each row's tokens: {0 if histories is None else len(histories)} "
                         f"histories for {len(params)} rows")

    flat_x = x.view(-1)                          # x is a fresh contiguous copy
    rep = [j for j, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep:
        seen, _ = _pairs([histories[rows[j]][0] for j in rep], [rows[j] for j in rep], vocab, dev)
        r = _per_pair({rows[j]: p.repetition_penalty for j, p in enumerate(ps)}, seen, vocab, len(params))
        y = flat_x[seen]
        flat_x[seen] = torch.where(y > 0, y / r, y * r)

    fp = [j for j, p in enumerate(ps) if p.frequency_penalty or p.presence_penalty]
    if fp:
        gen = []
        for j in fp:
            tokens, num_prompt = histories[rows[j]]
            gen.append(tokens[num_prompt:])
        pairs, counts = _pairs(gen, [rows[j] for j in fp], vocab, dev)
        freq = _per_pair({rows[j]: p.frequency_penalty for j, p in enumerate(ps)}, pairs, vocab, len(params))
        pres = _per_pair({rows[j]: p.presence_penalty for j, p in enumerate(ps)}, pairs, vocab, len(params))
        flat_x.index_add_(0, pairs, -(freq * counts + pres))

    return x
