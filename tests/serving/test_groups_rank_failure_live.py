"""``residency serve --tp 2`` on the CPU (gloo): a sequence that fails on one rank alone (as a
restore of that rank's shard failing its checksum would) is cancelled on the other rank and the
client is answered the error naming the rank; the group goes on serving. Without the cancel, the
rank that still holds the sequence would post it in every round, the failed rank never would,
and the request would wait forever with its pages held on the healthy rank.

Real processes, a tiny random Llama whose heads divide by 2, the HTTP API, the ledger. Rank 1
fails the 2nd sequence it is told (``fail_seq=2``).
"""
from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.serving.helpers_groups import CLI, tiny_tp2, wait_healthy
from tests.serving.server import read_ledger


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from tiny_tp2(tmp_path_factory, "rankfail", "on_rank=1,fail_seq=2")


def test_a_sequence_one_rank_fails_is_cancelled_on_its_peers_and_answered_naming_the_rank(server):
    s = server
    model = wait_healthy(s)
    body = {"model": model, "prompt": "the sea and the lighthouse", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    first = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
    assert first.status_code == 200, first.text
    second = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)     # rank 1 fails it alone
    assert second.status_code == 500, second.text
    said = second.json()["error"]["message"]
    assert "rank 1 (worker 1) of group tp0 failed it" in said and "fail_seq" in said, said
    third = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)      # the group goes on serving
    assert third.status_code == 200, third.text
    assert third.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    assert s.stop() == 0

    events, state = read_ledger(s.ledger)
    state.check_integrity()
    out = subprocess.run([*CLI, "ledger", "verify", "--db", s.ledger], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    es = [r.event for r in events]
    of = lambda name: [e for e in es if type(e).__name__ == name]     # noqa: E731
    admitted = [e.request_id for e in of("RequestAdmitted")]
    assert len(admitted) == 3
    finished = {e.request_id: e.reason for e in of("RequestFinished")}
    assert [finished[r] for r in admitted] == ["length", "error", "length"]
    assert not of("GroupStopped") and not of("GroupDiverged")
    # the failed sequence's pages freed on both ranks, once each: nothing held on either
    for w in (0, 1):
        freed = [b for e in of("BlocksFreed") if e.worker == w for b in e.blocks]
        assert len(freed) == len(set(freed)), f"worker {w} freed a page twice"
        assert state.workers[w].tiers["device"].used_bytes == 0, f"worker {w} still holds pages"
