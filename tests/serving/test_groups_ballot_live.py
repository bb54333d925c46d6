"""``residency serve --tp 2`` on the CPU (gloo): the ranks' ballots split before a step, and no
rank runs it. Real processes, a tiny random Llama whose heads divide by 2, the HTTP API, the ledger.

Rank 1 posts another digest for the 2nd sequence it is told (``diverge_ballot=2``): the first
request is served; the second is never stepped by any rank (no StepCompleted from either rank
from that step on); GroupDiverged(caught_by="ballot") and GroupStopped name the ballot and the
request; that request and later ones are answered 503 ``group_stopped``; /health names it; the
ledger replays true and ``residency diagnose`` says it was caught before the step.
(The post-step comparison, ``diverge_table``, is tested in test_groups_live.py.)
"""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.serving.helpers_groups import CLI, tiny_tp2, wait_healthy
from tests.serving.server import read_ledger

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_tp2(tmp_path_factory, "ballot", "on_rank=1,diverge_ballot=2")


def test_ranks_whose_ballots_split_run_no_step_and_stop_the_group_naming_the_request(server):
    s = server
    model = wait_healthy(s)
    body = {"model": model, "prompt": "the sea and the lighthouse", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    second = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
    assert second.status_code == 503, second.text
    err = second.json()["error"]
    assert err["code"] == "group_stopped" and "group tp0 stopped at step" in err["message"], err
    assert "ballots differ for request" in err["message"] and "before step" in err["message"], err
    third = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)      # never served by one rank alone
    said = third.json()["error"]["message"]
    assert third.status_code == 503 and third.json()["error"]["code"] == "group_stopped" and said in err["message"]
    health = httpx.get(f"{s.url}/health", timeout=10)
    assert health.status_code == 503 and said in health.json()["problems"]
    s.stop()

    events, state = read_ledger(s.ledger)
    state.check_integrity()
    out = subprocess.run([*CLI, "ledger", "verify", "--db", s.ledger], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    es = [r.event for r in events]
    of = lambda name: [e for e in es if type(e).__name__ == name]     # noqa: E731
    admitted = [e.request_id for e in of("RequestAdmitted")]
    assert len(admitted) >= 2
    [div] = of("GroupDiverged")
    assert (div.group, div.caught_by, div.request_id) == ("tp0", "ballot", admitted[1])
    assert div.round is not None and sorted(div.digests_by_rank) == ["0", "1"]
    assert div.digests_by_rank["0"] != div.digests_by_rank["1"]
    [stop] = of("GroupStopped")
    assert stop.step == div.step and "ballots differ" in stop.reason and admitted[1] in stop.reason
    assert admitted[1] in err["message"]
    # no rank ran the refused step, or any after it; every step before it both ranks ran alike
    steps: dict[int, dict[int, tuple]] = {}
    for e in of("StepCompleted"):
        steps.setdefault(e.step, {})[e.worker] = (e.batch_digest, e.tables_digest)
    assert steps and max(steps) == div.step - 1
    assert all(sorted(by) == [0, 1] and len(set(by.values())) == 1 for by in steps.values())
    out = subprocess.run([*CLI, "diagnose", "--db", s.ledger, "--json"], capture_output=True, text=True, timeout=120)
    [f] = [f for f in json.loads(out.stdout)["findings"] if f["detector"] == "group_divergence"]
    assert f["subject"] == "group tp0" and f["detail"]["first_step"] == div.step
    assert f["detail"]["caught_by"] == "ballot" and f["detail"]["request_id"] == admitted[1]
    assert f"caught before step {div.step} ran" in f["title"]
