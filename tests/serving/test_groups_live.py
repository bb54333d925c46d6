"""``residency serve --tp N`` on the CPU (gloo): real processes, the embedded SmolLM2 split over 3
ranks (9 query heads, 3 KV heads), the HTTP API, the ledger.

Three serve starts, all at once (the CPU is shared; each start is most of this file's time):
    tp1    the reference: greedy output of one worker
    tp3    --tp 3 with faults: rank 1's move outcomes are dropped and its moves take 3 s; rank 2
           changes the block table of the 5th sequence it runs. In order: greedy output against
           tp1; a park whose rank-1 shard is stranded while the others are acked; the divergence
           STOP; rank 1 killed mid-move; the ledger replays true and `residency diagnose` shows it
    tp2    refused at start: SmolLM2's heads do not divide by 2
    pair   --tp 2 (gloo) with a tiny random Llama whose heads divide by 2: it serves, both ranks step
           alike and move their halves of each block; its pool is resized as one group: rank 1's
           serving loop misses its stamp on the first rebind (tearing the group), then a complete
           group resize repairs it shrunk, and another grows it, the greedy text unchanged
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time

import httpx
import pytest

from residency.dataplane.model import random_model
from tests.model.helpers_model import write_hf_dir
from tests.serving.helpers_groups import CLI, COMMON, TINY_LLAMA
from tests.serving.server import MODEL, Server, read_ledger

PROMPTS = ["The capital of France is", "Write one sentence about the sea and a lighthouse keeper."]
# requests 1-2: the greedy prompts, 3-4: alice's and bob's turns, 5: the one whose table rank 2 changes
FAULTS = "on_rank=1,drop_ack=1,exec_delay_ms=3000;on_rank=2,diverge_table=5"
PAIR_FAULTS = "on_rank=1,miss_stamp=serving"       # rank 1 only, on the group's first rebind


def start(tmp, name: str, *extra: str, faults: str = "") -> Server:
    return Server(tmp, *COMMON, *extra, name=name, faults=faults)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    tiny = str(tmp / "tiny-llama")
    write_hf_dir(tiny, random_model(TINY_LLAMA, seed=random.randrange(1 << 30)))
    started = {"tp1": start(tmp, "tp1"), "tp3": start(tmp, "tp3", "--tp", "3", faults=FAULTS),
               "tp2": start(tmp, "tp2", "--tp", "2"),
               "pair": start(tmp, "pair", "--tp", "2", "--model", tiny, "--max-context", "512", faults=PAIR_FAULTS)}
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


def complete(server: Server, prompt: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, "ignore_eos": True}, timeout=120)


def chat(server: Server, text: str, session: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "session_id": session})


def test_tp2_of_smollm2_is_refused_at_start_with_the_arithmetic(servers):
    s = servers["tp2"]
    rc = s.proc.wait(180)
    s.log.close()
    assert rc != 0
    text = s.log_path.read_text()
    assert "refused to start" in text and "num_heads 9 % 2 = 1" in text and "num_kv_heads 3 % 2 = 1" in text


def test_two_ranks_serve_a_model_that_splits_and_step_and_move_alike(servers):
    s = servers["pair"]
    deadline = time.monotonic() + 180          # Server.wait_ready waits for SmolLM2 by name
    while time.monotonic() < deadline and s.proc.poll() is None:
        try:
            if httpx.get(f"{s.url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    model = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "session_id": "carol"}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert s.admin("POST", "/admin/sessions/carol/park").status_code == 200
    resize_the_group(s, model)
    s.stop()
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    es = [r.event for r in events]
    joined = {e.worker: e for e in es if type(e).__name__ == "WorkerJoined"}
    whole = 2 * TINY_LLAMA.num_layers * 16 * TINY_LLAMA.num_kv_heads * TINY_LLAMA.head_dim * 4    # float32 pages
    assert {w: (j.group, j.rank, j.block_bytes) for w, j in joined.items()} == {0: ("tp0", 0, whole // 2),
                                                                              1: ("tp0", 1, whole // 2)}
    steps: dict[int, dict[int, tuple]] = {}
    for e in es:
        if type(e).__name__ == "StepCompleted":
            steps.setdefault(e.step, {})[e.worker] = (e.batch_digest, e.tables_digest)
    assert len(steps) >= 12 and all(len(set(by.values())) == 1 and len(by) == 2 for by in steps.values())
    assert not [e for e in es if type(e).__name__ in ("GroupDiverged", "GroupStopped")]
    parks = [e for e in es if type(e).__name__ == "MoveRequested" and e.kind == "park"][:2]   # carol's (dave's follow)
    assert sorted(e.worker for e in parks) == [0, 1] and len({tuple(e.blocks) for e in parks}) == 1
    acked = {e.move_id: e for e in es if type(e).__name__ == "MoveAcked"}
    assert [acked[e.move_id].bytes_moved for e in parks] == [len(parks[0].blocks) * whole // 2] * 2
    check_group_resizes(es, whole // 2)


def resize(s: Server, worker: int, nbytes: int) -> httpx.Response:
    return s.admin("POST", "/admin/resize", json={"worker": worker, "tier": "device", "bytes": nbytes})


def device_bytes(s: Server, worker: int, what: str = "capacity") -> int:
    for line in httpx.get(f"{s.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"residency_tier_{what}_bytes{{") and f'worker="{worker}"' in line and 'tier="device"' in line:
            return int(float(line.rpartition(" ")[2]))
    raise AssertionError(f"no device {what} for worker {worker}")


def resize_the_group(s: Server, model: str) -> None:
    """One resize of the pair's pool is one decision for both ranks, committed on both or torn."""
    body = {"model": model, "prompt": "the sea and the lighthouse", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    text = lambda: httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]  # noqa: E731
    before = text()
    full = device_bytes(s, 0)
    assert device_bytes(s, 1) == full
    shard = 2 * TINY_LLAMA.num_layers * 16 * TINY_LLAMA.num_kv_heads * TINY_LLAMA.head_dim * 4 // 2
    # dave's and erin's idle pages stay on the device; the shrink leaves room for one page fewer
    # than they hold, so the coldest must leave first: a group eviction (one move per rank, the same
    # blocks). Two sessions: the pool keeps one sequence of the whole context (--max-context 512)
    for session in ("dave", "erin"):
        text_of_turn = f"I am {session}. " + "tell me about rivers " * 12
        chat = {"model": model, "messages": [{"role": "user", "content": text_of_turn}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True, "session_id": session}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    used = device_bytes(s, 0, "used")
    assert used == device_bytes(s, 1, "used") >= 2 * shard
    small = used - shard
    assert small >= 512 // 16 * shard, (used, shard)     # above the context floor: a shrink may go there
    # a follower's own view never decides: the group is resized through its leader
    r = resize(s, 1, small)
    assert r.status_code == 400 and "resize its leader, worker 0" in r.json()["error"]["message"], r.text
    # rank 1's serving loop misses its stamp: both ranks resized, and both rebinds are torn
    r = resize(s, 0, small)
    assert r.status_code == 503 and r.json()["outcome"] == "torn", r.text
    torn = {e["rebind_id"]: e["readers_behind"] for e in r.json()["events"] if e["type"] == "RebindTorn"}
    assert sorted(torn.values()) == [["serving"], ["worker 1: serving"]], torn
    health = httpx.get(f"{s.url}/health", timeout=10)
    assert health.status_code == 503 and all(rid in json.dumps(health.json()) for rid in torn)
    # a complete group resize repairs it at that size; dave parked makes room; then it grows back
    r = resize(s, 0, small)
    assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
    assert device_bytes(s, 0) == device_bytes(s, 1) == small
    assert s.admin("POST", "/admin/sessions/dave/park").status_code == 200
    assert text() == before                      # placement, never numerics
    r = resize(s, 0, full)
    assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
    assert device_bytes(s, 0) == device_bytes(s, 1) == full
    assert text() == before
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200


def check_group_resizes(es: list, shard: int) -> None:
    """Three resizes, each a RebindRequested and a PoolResized on every rank; the first (after
    its group evictions) torn on both ranks, the others committed once per rank."""
    reqs = [e for e in es if type(e).__name__ == "RebindRequested"]
    assert [e.worker for e in reqs] == [0, 1] * 3
    assert [e.rebind_id.rpartition(".")[2] for e in reqs] == ["r0", "r1"] * 3
    evicts: dict[tuple, list[int]] = {}
    for e in es:
        if type(e).__name__ == "MoveRequested" and e.kind == "evict" and e.src == "device":
            evicts.setdefault(tuple(e.blocks), []).append(e.worker)
    assert evicts and all(sorted(ws) == [0, 1] for ws in evicts.values()), evicts   # group evictions
    resized = [e for e in es if type(e).__name__ == "PoolResized"]
    assert sorted(e.worker for e in resized) == [0, 0, 0, 1, 1, 1]
    assert all(e.to_bytes % shard == 0 and e.measured_freed_bytes is None for e in resized)   # CPU: not measured
    verdict = {e.rebind_id: type(e).__name__ for e in es if type(e).__name__ in ("RebindCommitted", "RebindTorn")}
    assert [verdict[e.rebind_id] for e in reqs] == ["RebindTorn"] * 2 + ["RebindCommitted"] * 4


def test_one_group_of_three_ranks_serves_moves_stops_and_replays_true(servers):
    one, s = servers["tp1"].wait_ready(), servers["tp3"].wait_ready()
    # --- the greedy output of 3 ranks is one worker's
    for prompt in PROMPTS:
        a, b = complete(one, prompt), complete(s, prompt)
        assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
        assert b.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
    one.stop()                      # the reference is done: its CPU goes to the group
    for session in ("alice", "bob"):
        assert chat(s, f"Hello, I am {session}. Tell me about the sea.", session).status_code == 200
    # --- rank 1 runs its shard of alice's park 3 s and its answer is dropped: stranded at the
    # deadline, while ranks 0 and 2 answer at once
    s.admin("POST", "/admin/sessions/alice/park")
    # --- rank 2's table of the 5th sequence differs: the group stops at that step
    r = complete(s, PROMPTS[1], 16)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "group_stopped" and "group tp0 stopped at step" in err["message"], err
    again = complete(s, PROMPTS[0], 4)     # never served by the ranks that agree: the group is stopped
    said = again.json()["error"]["message"]
    assert again.status_code == 503 and again.json()["error"]["code"] == "group_stopped" and said in err["message"]
    health = httpx.get(f"{s.url}/health", timeout=10)
    assert health.status_code == 503 and said in health.json()["problems"]
    # --- rank 1 killed while it runs its shard of bob's park (moves go on: the group serves no
    # requests, its pages are still the ledger's)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.admin("POST", "/admin/sessions/bob/park")))
    t.start()
    time.sleep(1.0)
    os.kill(int((s.dir / "run" / "worker-1.pid").read_text().split()[0]), signal.SIGKILL)
    t.join(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "group_rank_lost" not in s.tail(400):
        time.sleep(0.3)
    s.stop()
    check_ledger(s)


def check_ledger(s: Server) -> None:
    events, state = read_ledger(s.ledger)
    state.check_integrity()                  # the invariants hold on replay
    out = subprocess.run([*CLI, "ledger", "verify", "--db", s.ledger], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr      # replay = live at every checkpoint
    es = [r.event for r in events]
    of = lambda name: [e for e in es if type(e).__name__ == name]     # noqa: E731
    joined = {e.worker: e for e in of("WorkerJoined")}
    assert {w: (j.group, j.rank) for w, j in joined.items()} == {0: ("tp0", 0), 1: ("tp0", 1), 2: ("tp0", 2)}
    shard = joined[0].block_bytes
    assert joined[1].block_bytes == joined[2].block_bytes == shard
    parks: dict[tuple, dict[int, object]] = {}
    for e in of("MoveRequested"):
        if e.kind == "park":
            parks.setdefault(tuple(e.blocks), {})[e.worker] = e
    alice, bob = parks.values()
    assert sorted(alice) == sorted(bob) == [0, 1, 2]       # one logical move, one per rank, the same blocks
    outcome: dict[str, list] = {}
    for e in es:
        if type(e).__name__ in ("MoveAcked", "MoveStranded", "MoveAbandoned", "MoveFailed", "MoveLateAcked"):
            outcome.setdefault(e.move_id, []).append(e)
    # alice: ranks 0 and 2 acked their shards; rank 1's shard stranded with its bytes, never zero
    for w in (0, 2):
        acked = outcome[alice[w].move_id][0]
        assert type(acked).__name__ == "MoveAcked" and acked.bytes_moved == len(alice[w].blocks) * shard
    stranded = outcome[alice[1].move_id][0]
    assert type(stranded).__name__ == "MoveStranded" and stranded.why == "deadline"
    assert stranded.bytes_at_risk == len(alice[1].blocks) * shard > 0
    # the divergence: every rank's digest of the step, rank 2's differs; the stop names the step
    [div] = of("GroupDiverged")
    assert div.group == "tp0" and sorted(div.digests_by_rank) == ["0", "1", "2"]
    d = div.digests_by_rank
    assert d["0"] == d["1"] != d["2"]
    stop, lost_stop = of("GroupStopped")
    assert stop.step == div.step and f"diverged at step {div.step}" in stop.reason
    # bob: rank 1 lost mid-move: WorkerLost names its blocks; its shard's move is settled under the loss
    [lost] = [e for e in of("WorkerLost") if e.worker == 1]
    assert set(bob[1].blocks) <= set(lost.blocks_lost) and lost.bytes_lost > 0
    assert type(outcome[bob[1].move_id][-1]).__name__ in ("MoveStranded", "MoveAbandoned")
    assert "rank 1 (worker 1) lost" in lost_stop.reason and set(bob[1].blocks) <= set(lost_stop.blocks)
    out = subprocess.run([*CLI, "diagnose", "--db", s.ledger, "--json"], capture_output=True, text=True, timeout=120)
    [f] = [f for f in json.loads(out.stdout)["findings"] if f["detector"] == "group_divergence"]
    assert f["subject"] == "group tp0" and f["detail"]["first_step"] == div.step and f["until_ns"] is not None
