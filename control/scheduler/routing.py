"""Which worker runs a request. Pure.

Before the prompt is known, a request goes where its session lives, else to the worker with the
fewest requests in hand (``by_load``); that worker tokenizes it. Once its content keys are known,
a request that no session pins may move to another worker serving the same model whose sessions
hold more of its opening pages (``by_prefix``): the pages it would otherwise prefill are read in
place or copied there (``sharing.py``), which is worth more than an even spread, up to a point.

    worker 0: 3 requests in hand, session "a" holds the system prompt's 40 pages
    worker 1: 1 request in hand, nothing shared
    a request that opens with that system prompt, tokenized on worker 1:
        slack 4: 3 <= 1 + 4, so worker 0 (40 pages shared instead of 0 computed on worker 1)
        slack 1: 3 >  1 + 1, so it stays on worker 1 (worker 0 is too far behind)

Among the workers within ``slack`` requests of the least loaded, the most shareable pages win;
on a tie the request stays where it is, so routing never moves one for nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

# How many more requests in hand than the least loaded worker a worker may have and still be
# chosen for the pages it shares (a page read in place saves its prefill; a queue behind a worker
# costs every request in it a slot in the batch, so the slack is small).
PREFIX_ROUTE_SLACK = 4


def by_load(alive: Iterable[int], load: Mapping[int, int]) -> int | None:
    """The least loaded worker (lowest number on a tie), or None when none is alive."""
    return min(alive, key=lambda w: (load.get(w, 0), w), default=None)


def by_prefix(current: int, shared_pages: Mapping[int, int], load: Mapping[int, int],
              slack: int = PREFIX_ROUTE_SLACK) -> int:
    """The worker for a request tokenized on ``current``: of the workers in ``shared_pages`` (its
    candidates, ``current`` among them, each with the pages of the prompt it could share) within
    ``slack`` requests of the least loaded, the one sharing the most; ``current`` on a tie."""
    if current not in shared_pages:
        raise ValueError(f"worker {current} is not among the candidates {sorted(shared_pages)}")
    least = min(load.get(w, 0) for w in shared_pages)
    best, best_pages = current, shared_pages[current]
    for w in sorted(shared_pages):
        if load.get(w, 0) <= least + slack and shared_pages[w] > best_pages:
            best, best_pages = w, shared_pages[w]
    return best
