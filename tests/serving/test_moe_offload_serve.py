"""An OLMoE model served with a quarter of its expert bytes on the device (``serve --expert-budget
25%``): greedy text over the HTTP API equals the all-resident runner's; every expert move is in
the ledger, and `residency audit experts` reads them back."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from residency.control.cli.main import main
from residency.events import catalog as ev
from tests.model.test_model_moe import TINY_OLMOE
from tests.serving.helpers_moe import assert_runner_agrees, greedy_chat, tiny_olmoe_served
from tests.serving.server import read_ledger

pytestmark = [pytest.mark.slow]


def test_experts_offloaded_to_a_quarter_serve_the_all_resident_text_and_every_move_is_recorded(tmp_path, rng, capsys):
    messages = [{"role": "user", "content": "which experts answer, and where do they live?"}]
    with tiny_olmoe_served(tmp_path, rng, "--expert-budget", "25%") as (server, path):
        body = greedy_chat(server, messages, 16)
        scraped = httpx.get(f"{server.url}/metrics", timeout=30).text

    # the all-resident model, through the runner alone
    assert_runner_agrees(path, messages, 16, body)

    events, _ = read_ledger(server.ledger)
    moved = [r.event for r in events if type(r.event) is ev.ExpertsMoved]
    slots = TINY_OLMOE.num_experts // 4
    first, rest = moved[0], moved[1:]
    assert first.step == 0 and len(first.moves) == TINY_OLMOE.num_layers * slots          # the placement
    assert {m.kind for m in first.moves} == {"fetch"}
    assert rest and all(e.step > 0 for e in rest) and any(m.kind == "evict" for e in rest for m in e.moves)
    assert all(m.ns is not None for e in moved for m in e.moves)
    steps = {r.event.step for r in events if type(r.event) is ev.StepCompleted}
    assert {e.step for e in rest} <= steps
    # /metrics counted the same events as the control recorded them: those of the first k steps (a
    # step's ExpertsMoved may still be on its way when the answer is scraped)
    got = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in scraped.splitlines()
           if ln.startswith("residency_expert_")}
    prefixes = [moved[:k] for k in range(1, len(moved) + 1)]
    assert any(got == {"residency_expert_fetched_bytes_total": sum(e.fetched_bytes for e in p),
                       'residency_expert_served_bytes_total{source="device"}': sum(e.served_device_bytes for e in p),
                       'residency_expert_served_bytes_total{source="fetched"}': sum(e.served_fetched_bytes for e in p),
                       **{f'residency_expert_moves_total{{kind="{k}"}}': sum(m.kind == k for e in p for m in e.moves)
                          for k in {m.kind for e in p for m in e.moves}}}
               for p in prefixes), got
    pinned = [r.event for r in events if type(r.event) is ev.PinnedRegistered and r.event.owner == "experts"]
    assert sum(p.bytes for p in pinned) >= first.host_bytes

    assert main(["audit", "experts", "--db", server.ledger, "--json"]) == 0
    (w,) = json.loads(capsys.readouterr().out)["workers"]
    eb = TINY_OLMOE.expert_bytes(torch.float32)
    assert w["tiers"] == {"host": TINY_OLMOE.num_layers * TINY_OLMOE.num_experts * eb,
                          "device": TINY_OLMOE.num_layers * slots * eb}
    assert 0 < w["served_from_device"] < 1
    assert sum(x["fetches"] for x in w["experts"]) <= sum(1 for e in moved for m in e.moves if m.kind == "fetch")

    # the detectors read the same rows (an expert_thrash finding is fair at a quarter: routing is random)
    assert main(["diagnose", "--db", server.ledger, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["findings"]
    assert all(f["detector"] in ("expert_thrash",) for f in found if f["severity"] != "info"), found
