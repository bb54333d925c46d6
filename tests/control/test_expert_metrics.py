"""/metrics counts an offloaded MoE model's expert moves as the control records its ExpertsMoved
events (the listener ``ServingStats.observe``): moves by kind, bytes copied host -> device, and the
routed experts' bytes served from the device vs fetched."""
from __future__ import annotations

import collections
import random

from residency.control.api.metrics import ApiMetrics
from residency.control.scheduler.port import BackendStats
from residency.control.scheduler.stats import ServingStats
from residency.events import catalog as ev


def _step(rng: random.Random, step: int) -> ev.ExpertsMoved:
    moves = [ev.ExpertMove(kind=rng.choice(ev.EXPERT_MOVE_KINDS), layer=rng.randrange(8), expert=rng.randrange(64),
                           bytes=rng.randrange(1 << 16, 1 << 24), ns=rng.randrange(1, 1 << 20))
             for _ in range(rng.randrange(1, 12))]
    return ev.ExpertsMoved(worker=0, step=step, moves=moves,
                           fetched_bytes=sum(m.bytes for m in moves if m.kind != "evict"),
                           device_bytes=rng.randrange(1 << 30), host_bytes=rng.randrange(1 << 30, 1 << 34),
                           served_device_bytes=rng.randrange(1 << 28), served_fetched_bytes=rng.randrange(1 << 28))


class _Backend:
    def __init__(self, stats: ServingStats):
        self.serving = stats

    def stats(self) -> BackendStats:
        return BackendStats(**self.serving.expert_fields())


def _metrics(text: str) -> dict[str, float]:
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("residency_expert_")}


def test_expert_moves_and_bytes_reach_metrics_as_recorded():
    rng = random.Random()
    stats = ServingStats(None, None, None, None, None)      # observe needs none of them for these events
    metrics = ApiMetrics(_Backend(stats))
    before = _metrics(metrics.render()[0].decode())
    assert before == {"residency_expert_fetched_bytes_total": 0.0}      # no MoE worker: nothing moved, none served
    events = [_step(rng, s) for s in range(1, rng.randrange(3, 9))]
    for e in events:
        stats.observe(e)
        stats.observe(ev.StepCompleted(worker=0, step=e.step, batch_digest="", num_seqs=1, num_tokens=1,
                                       duration_ns=rng.randrange(1, 1 << 30)))      # a step: no expert counted
    got = _metrics(metrics.render()[0].decode())
    kinds = collections.Counter(m.kind for e in events for m in e.moves)
    for k in ev.EXPERT_MOVE_KINDS:
        assert got.get(f'residency_expert_moves_total{{kind="{k}"}}', 0.0) == kinds[k]
    assert got["residency_expert_fetched_bytes_total"] == sum(e.fetched_bytes for e in events)
    assert got['residency_expert_served_bytes_total{source="device"}'] == sum(e.served_device_bytes for e in events)
    assert got['residency_expert_served_bytes_total{source="fetched"}'] == sum(e.served_fetched_bytes
                                                                                 for e in events)
