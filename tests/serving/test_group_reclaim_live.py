"""An outside tenant's reclaim of a tensor-parallel group's memory: ``residency serve --tp 3`` on the
CPU (gloo, the embedded SmolLM2 split over 3 ranks), SQLite.

Asked of the leader, the group's idle pages leave every rank (group moves: one per rank, the same
blocks), every rank's device pool shrinks by the same pages, and each rank records its own grant
(its shard's bytes, its rebind, its measured bytes: null on a CPU, never 0). The answer is the
group's figure. ``ctl release`` gives it back on every rank. The greedy text is the same before,
during and after; the ledger verifies. Asked of a follower, a reclaim or release is refused naming
the leader."""
from __future__ import annotations

import subprocess
import sys

import httpx

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

CLI = [sys.executable, "-m", "residency.control.cli.main"]
RANKS = [0, 1, 2]
# --max-context 256: one sequence of the whole context is 16 pages, which the reclaims leave
COMMON = ("--drain-s", "0", "--no-policies", "--retain-prefixes", "0", "--no-keep-disk", "--max-context", "256",
          "--tenant", "trainer", "--tp", "3")
PROMPT = "Write one sentence about the sea and a lighthouse keeper."


def greedy(s: Server) -> str:
    r = httpx.post(f"{s.url}/v1/completions", timeout=180, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def status(s: Server):
    from residency.control.state import decode_state
    from residency.control.transport import AskClient, ask_endpoint
    from residency.events.asks import AskStatus
    from residency.events.handshake import key_in

    run_dir = s.dir / "run"
    rep = AskClient(ask_endpoint(run_dir), timeout_s=30, key=key_in(run_dir)).ask(AskStatus(ask_id="t"))
    return decode_state(rep.state)


def ctl(s: Server, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ctl", *argv, "--db", s.ledger, "--run-dir", str(s.dir / "run")],
                          capture_output=True, text=True, timeout=180)


def pools(s: Server) -> dict[int, tuple[int, dict]]:
    """Each rank's device pool capacity and outside tenants, as the control holds them now."""
    st = status(s)
    return {w: (st.workers[w].tiers["device"].capacity_bytes, dict(st.workers[w].tenants)) for w in RANKS}


def test_a_tenant_reclaims_a_group_s_memory_on_every_rank_and_gives_it_back(tmp_path):
    s = Server(tmp_path, *COMMON, name="tp3").wait_ready()
    try:
        before = greedy(s)
        for name in ("alice", "bob"):           # idle sessions whose pages stay on every rank's device
            r = httpx.post(f"{s.url}/v1/chat/completions", timeout=180, json={
                "model": MODEL, "temperature": 0, "max_tokens": 4, "session_id": name,
                "messages": [{"role": "user", "content": f"I am {name}. " + "Tell me about the sea. " * 20}]})
            assert r.status_code == 200, r.text
        st = status(s)
        shard = st.workers[0].block_bytes
        assert all(st.workers[w].block_bytes == shard for w in RANKS)
        page = 3 * shard                        # a group's page: every rank's shard of one block
        full = pools(s)
        slots = full[0][0] // shard
        free = slots - st.workers[0].tiers["device"].used_bytes // shard
        assert all(cap == slots * shard and tenants == {} for cap, tenants in full.values())
        # a follower's view never decides: refused naming the leader, nothing recorded
        for path, body in (("/admin/reclaim", {"tenant": "trainer", "bytes": page, "worker": 1}),
                           ("/admin/release", {"tenant": "trainer", "worker": 2})):
            r = s.admin("POST", path, json=body)
            assert r.status_code == 400 and "ask its leader, worker 0" in r.json()["error"]["message"], r.text

        # more than is free: idle pages must leave first, every rank's shard of them
        ask = (free + 1) * page + 1
        pages = free + 2                        # the ask in whole group pages
        out = ctl(s, "reclaim", "--tenant", "trainer", "--bytes", str(ask))
        assert out.returncode == 0, out.stdout + out.stderr
        assert "the group's pools (workers 0, 1, 2) gave up" in out.stdout and "not measured" in out.stdout, out.stdout
        assert pools(s) == {w: (full[w][0] - pages * shard, {"trainer": pages * shard}) for w in RANKS}
        assert greedy(s) == before              # placement, never numerics
        out = ctl(s, "release", "--tenant", "trainer")
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("released by tenant trainer") == 3 and "took back" in out.stdout, out.stdout
        assert pools(s) == full

        # through the API: the answer is the group's figure, each rank's under "ranks"
        r = s.admin("POST", "/admin/reclaim", json={"tenant": "trainer", "bytes": ask})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["granted_bytes"] == pages * page >= ask and body["measured_bytes"] is None   # CPU: not measured
        assert [(g["worker"], g["granted_bytes"], g["measured_bytes"]) for g in body["ranks"]] == [
            (w, pages * shard, None) for w in RANKS]
        assert len({g["rebind_id"] for g in body["ranks"]}) == 3
        r = s.admin("POST", "/admin/release", json={"tenant": "trainer"})
        assert r.status_code == 200, r.text
        assert r.json()["bytes"] == pages * page and r.json()["measured_bytes"] is None
        assert [g["worker"] for g in r.json()["ranks"]] == RANKS
        assert pools(s) == full
        assert greedy(s) == before
    finally:
        s.stop()
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    es = [r.event for r in events]
    grants = [e for e in es if type(e) is ev.TenantReclaimed]
    assert [e.worker for e in grants] == RANKS * 2
    assert all(e.granted_bytes == pages * shard and e.measured_bytes is None for e in grants)
    first = grants[:3]
    assert first[0].moves and all(e.moves for e in first)          # every rank's own moves, none shared
    assert len({m for e in first for m in e.moves}) == sum(len(e.moves) for e in first)
    parks: dict[tuple, list[int]] = {}
    for e in es:
        if type(e) is ev.MoveRequested and e.kind == "park":
            parks.setdefault(tuple(e.blocks), []).append(e.worker)
    assert parks and all(sorted(ws) == RANKS for ws in parks.values()), parks      # group moves
    freed = {e.worker: e.freed_bytes for e in first}
    assert all(freed[w] > 0 for w in RANKS), freed                     # each rank's own acks
    resized = [e for e in es if type(e) is ev.PoolResized]
    assert sorted(e.worker for e in resized) == sorted(RANKS * 4) and all(e.measured_freed_bytes is None
                                                                          for e in resized)
    released = [e for e in es if type(e) is ev.TenantReleased]
    assert [(e.worker, e.bytes, e.measured_bytes) for e in released] == [(w, pages * shard, None) for w in RANKS] * 2
    assert all(state.workers[w].tenants == {} for w in RANKS)
    out = subprocess.run([*CLI, "ledger", "verify", "--db", s.ledger], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
