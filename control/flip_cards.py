"""What the API shows of the weights arenas: one card per model (``GET /v1/models``) and whether
any arena sleeps (``GET /is_sleeping``). Pure: the folded state and the workers' ServingReady in,
values out; the Flipper replaces its snapshots whole with them on the loop thread.
"""
from __future__ import annotations

from residency.control import flip
from residency.control.scheduler.port import ModelCard
from residency.control.state import State

_RANK = {"resident": 0, "asleep": 1, "host": 2, "file": 3}


def model_cards(state: State, ready: dict, on_host: dict[int, set[str]]) -> tuple[tuple[ModelCard, ...], bool]:
    """(a card per model, the best residency any worker gives it; whether any arena sleeps).
    ``ready``: worker -> its ServingReady; ``on_host``: worker -> models whose image it pins."""
    best: dict[str, tuple[str, int | None, int]] = {}    # model -> (residency, arena gen, max context)
    sleeping = False
    for w in list(ready):
        msg = ready[w]
        arena = flip.arena_of(state, w)
        sleeping = sleeping or bool(arena is not None and arena.asleep)
        for m in list(msg.models) or [None]:
            name = m.name if m is not None else msg.model
            ctx = m.max_context if m is not None else msg.max_context
            if arena is not None and arena.model == name:
                res, gen = ("asleep" if arena.asleep else "resident"), arena.gen
            else:
                res, gen = ("host" if name in on_host.get(w, ()) else "file"), None
            if name not in best or _RANK[res] < _RANK[best[name][0]]:
                best[name] = (res, gen, ctx)
    cards = tuple(ModelCard(id=n, max_context=ctx, created=0, residency=res, arena_gen=gen)
                  for n, (res, gen, ctx) in best.items())
    return cards, sleeping


__all__ = ["model_cards"]
