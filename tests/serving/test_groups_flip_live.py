"""Weight flips, sleep and wake of a tensor-parallel group: ``residency serve --tp 3`` on the CPU
(gloo), real processes, two models: the embedded SmolLM2 (9 query heads, 3 KV heads) and a random
Llama of another size whose heads and MLP width divide by 3 and whose KV pages are SmolLM2's (the
models of one worker share its pool). Each rank loads its share of both.

    flip   A -> B -> A (asked), B again (by the policy, for a request naming it), A again: each
           model's greedy text is what it was before; every flip is one FlipRequested and one
           FlipCompleted per rank; a flip asked of a follower is refused naming the leader; a
           level-1 sleep shrinks the group's pool on every rank, the wake grows it back, and the
           greedy text is the same
    torn   rank 2 refuses its first SwapWeights (worker fault refuse_swap=1) while ranks 0 and 1
           swap: the group is stopped and named (503 on requests and /health), ranks 0 and 1 are
           stranded, rank 2 kept its model; no rank's FlipCompleted is recorded

    lost   rank 1 of the first server stalls in its next SwapWeights and is killed: the flip is
           never completed on any rank, every rank's arena is stranded, the group is stopped

Both ledgers verify and replay after the run.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from residency.dataplane.model import ModelConfig, random_model
from residency.events import catalog as ev
from tests.model.helpers_model import write_hf_dir
from tests.serving.server import Server, read_ledger

CLI = [sys.executable, "-m", "residency.control.cli.main"]
COMMON = ("--drain-s", "0", "--no-policies", "--retain-prefixes", "0", "--no-keep-disk", "--tp", "3",
          "--flip-min-residency-s", "0", "--dtype", "float32")
# SmolLM2's KV page (30 layers, 3 KV heads of 64) with 3 query heads and a narrower residual stream
SMALL = ModelConfig(name="small", num_layers=30, hidden=96, num_heads=3, num_kv_heads=3, head_dim=64,
                    intermediate=192, vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                    max_position=2048, tie_embeddings=False)
RANKS = (0, 1, 2)
STALLED = 9       # rank 1 of "flip" stalls its 9th SwapWeights: the flip after the first test's eight


def start(tmp, name: str, small: str, faults: str = "") -> Server:
    return Server(tmp, *COMMON, "--model", "smol=embedded", "--model", f"small={small}", name=name,
                  device_blocks=48, faults=faults)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups-flip")
    small = str(tmp / "small")
    write_hf_dir(small, random_model(SMALL, seed=random.randrange(1 << 30)))
    started = {"flip": start(tmp, "flip", small, faults=f"on_rank=1,stall_swap={STALLED}:120000"),
               "torn": start(tmp, "torn", small, faults="on_rank=2,refuse_swap=1")}
    try:
        for s in started.values():
            wait_resident(s, "smol")
        yield started
    finally:
        for s in started.values():
            s.stop()


def wait_resident(s: Server, model: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert s.proc.poll() is None, s.tail()
        try:
            cards = {m["id"]: m for m in httpx.get(f"{s.url}/v1/models", timeout=2).json()["data"]}
            if cards.get(model, {}).get("residency") == "resident":
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, s.tail()
        time.sleep(0.5)


def chat(s: Server, model: str, text: str) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/chat/completions", timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def flip_to(s: Server, model: str, **body) -> httpx.Response:
    return s.admin("POST", "/admin/flip", json={"to": model, **body})


def per_rank(answer: dict, kind: str) -> list[dict]:
    return [e for e in answer["events"] if e["type"] == kind]


def verify(s: Server) -> None:
    out = subprocess.run([*CLI, "ledger", "verify", "--db", s.ledger], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_group_flips_sleeps_and_wakes_every_rank_at_once_and_keeps_each_models_text(servers):
    s = servers["flip"]
    smol = text_of(chat(s, "smol", "Name a colour."))
    r = flip_to(s, "small")
    assert r.status_code == 200 and r.json()["outcome"] == "completed", r.text
    done = per_rank(r.json(), "FlipCompleted")
    assert sorted(e["worker"] for e in done) == list(RANKS)
    assert all(e["checksum_ok"] and e["bytes_in"] > 0 and e["bytes_out"] > 0 for e in done), done
    fids = sorted(e["flip_id"] for e in per_rank(r.json(), "FlipRequested"))
    assert [f.rpartition(".")[2] for f in fids] == ["r0", "r1", "r2"], fids
    small = text_of(chat(s, "small", "Name a colour."))
    assert text_of(chat(s, "smol", "Name a colour.")) == smol        # the policy flips the group back
    follower = flip_to(s, "small", worker=1)
    assert follower.status_code == 400 and "leader, worker 0" in follower.text, follower.text
    assert text_of(chat(s, "small", "Name a colour.")) == small      # and to the other model again
    r = flip_to(s, "smol")
    assert r.status_code == 200 and r.json()["outcome"] == "completed", r.text
    assert text_of(chat(s, "smol", "Name a colour.")) == smol

    for level in (1, 2):      # level 2 drops the weights: each rank reads its share from the file again
        slept = s.admin("POST", f"/sleep?level={level}")
        assert slept.status_code == 200 and slept.json()["outcome"] == "completed", slept.text
        assert sorted(e["worker"] for e in per_rank(slept.json(), "FlipCompleted")) == list(RANKS)
        shrunk = slept.json()["kv_pool"]     # the group's pool, resized on every rank through the dial
        assert sorted(k["worker"] for k in shrunk if k["resized"]) == list(RANKS), shrunk
        assert httpx.get(f"{s.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        woke = s.admin("POST", "/wake_up")
        assert woke.status_code == 200 and woke.json()["outcome"] == "completed", woke.text
        grown = woke.json()["kv_pool"]
        assert sorted(k["worker"] for k in grown if k["resized"]) == list(RANKS), grown
        assert text_of(chat(s, "smol", "Name a colour.")) == smol

    events, state = read_ledger(s.ledger)         # every answer above came after its events' commit
    state.check_integrity()
    es = [r.event for r in events]
    asked = [e for e in es if type(e) is ev.FlipRequested]
    assert [(e.action, e.to_model) for e in asked[::3]] == [("flip", "small"), ("flip", "smol"), ("flip", "small"),
                                                          ("flip", "smol"), ("sleep", ""), ("wake", "smol"),
                                                          ("sleep", ""), ("wake", "smol")]
    assert [e.worker for e in asked] == list(RANKS) * (STALLED - 1)
    completed = {e.flip_id for e in es if type(e) is ev.FlipCompleted}
    assert completed == {e.flip_id for e in asked}
    assert {e.rebind_id for e in es if type(e) is ev.RebindCommitted} >= completed
    assert not [e for e in es if type(e) in (ev.FlipFailed, ev.GroupStopped, ev.GroupDiverged)]
    assert {w: (state.arenas[f"{w}:weights"].model, state.arenas[f"{w}:weights"].asleep) for w in RANKS} == {
        w: ("smol", False) for w in RANKS}
    verify(s)


def test_a_rank_that_refuses_its_swap_stops_the_group_never_half_flipped(servers):
    s = servers["torn"]
    smol = text_of(chat(s, "smol", "Name a colour."))
    assert smol
    r = flip_to(s, "small")
    assert r.status_code == 503 and r.json()["outcome"] == "stranded", r.text
    assert not per_rank(r.json(), "FlipCompleted")
    failed = {e["flip_id"].rpartition(".")[2]: e for e in per_rank(r.json(), "FlipFailed")}
    assert sorted(failed) == ["r0", "r1", "r2"]
    assert failed["r0"]["stranded"] and failed["r1"]["stranded"] and not failed["r2"]["stranded"], failed
    assert "refuse_swap" in failed["r2"]["error"] and "torn" in failed["r0"]["error"], failed
    refused = chat(s, "smol", "Name a colour.")
    assert refused.status_code == 503 and "group tp0 stopped" in refused.text, refused.text
    health = httpx.get(f"{s.url}/health", timeout=10)
    assert health.status_code == 503 and "group tp0 stopped" in health.text, health.text
    s.stop()

    events, state = read_ledger(s.ledger)
    state.check_integrity()
    es = [r.event for r in events]
    [stopped] = [e for e in es if type(e) is ev.GroupStopped]
    assert stopped.group == "tp0" and "torn" in stopped.reason and "worker 2: refused" in stopped.reason
    assert not [e for e in es if type(e) is ev.FlipCompleted]
    arenas = {w: state.arenas[f"{w}:weights"] for w in RANKS}
    assert [bool(arenas[w].stranded) for w in RANKS] == [True, True, False]
    assert arenas[2].model == "smol"
    verify(s)


def test_a_rank_lost_in_the_middle_of_a_group_flip_strands_the_group_never_completes_it(servers):
    s = servers["flip"]           # after the first test: rank 1 stalls in this flip's SwapWeights
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=flip_to(s, "small")))
    t.start()
    deadline = time.monotonic() + 120
    while "fault_injected_stall" not in s.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline and t.is_alive(), s.tail()
        time.sleep(0.2)
    os.kill(int((s.dir / "run" / "worker-1.pid").read_text().split()[0]), signal.SIGKILL)
    t.join(180)
    r = out["r"]
    assert r.status_code == 503 and r.json()["outcome"] == "stranded", r.text
    assert not per_rank(r.json(), "FlipCompleted")
    failed = {e["flip_id"].rpartition(".")[2]: e for e in per_rank(r.json(), "FlipFailed")}
    assert sorted(failed) == ["r0", "r1", "r2"] and all(e["stranded"] for e in failed.values()), failed
    assert "worker 1: no answer" in failed["r0"]["error"], failed
    refused = chat(s, "smol", "Name a colour.")
    assert refused.status_code == 503 and "group tp0 stopped" in refused.text, refused.text
    s.stop()
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    es = [r.event for r in events]
    asked = [e for e in es if type(e) is ev.FlipRequested][-3:]
    assert [e.worker for e in asked] == list(RANKS)
    ended = [e for e in es if type(e) in (ev.FlipCompleted, ev.FlipFailed) and e.flip_id in {a.flip_id for a in asked}]
    assert sorted(type(e).__name__ for e in ended) == ["FlipFailed"] * 3
    assert [e for e in es if type(e) is ev.GroupStopped]
    assert all(state.arenas[f"{w}:weights"].stranded for w in RANKS)
    verify(s)
