"""Which pages of a prompt are already computed: prefix reuse by content key. Pure.

A full page's content key hashes every token up to its end (chained, like vLLM's block hash),
so equal keys at page i mean equal tokens in pages 0..i. The partial tail page has key "" and
never matches.

    session pages:  [k0][k1][k2][k3][ ""]         (kv of the last turn: prompt + reply)
    new prompt:     [k0][k1][k2][k4][k5][..]      → reuse 3 pages, compute the rest
                     └─ reused ─┘└ new pages ──┘

At least one prompt token is always computed (its logits choose the first output token), so a
prompt that is entirely cached gives back its last page.
"""
from __future__ import annotations


def num_matching_pages(held_keys: list[str], prompt_keys: list[str], prompt_tokens: int, page_tokens: int) -> int:
    n = 0
    limit = min(len(held_keys), len(prompt_keys))
    while n < limit and held_keys[n] and held_keys[n] == prompt_keys[n]:
        n += 1
    while n > 0 and n * page_tokens >= prompt_tokens:
        n -= 1
    return n


def pages_for(num_tokens: int, page_tokens: int) -> int:
    return -(-num_tokens // page_tokens)


def pages_needed(prompt_tokens: int, max_tokens: int, page_tokens: int) -> int:
    """Pages a sequence may write: every prompt position and every generated token but the last
    (the last sampled token is returned, never fed back)."""
    return pages_for(prompt_tokens + max(0, max_tokens - 1), page_tokens)
