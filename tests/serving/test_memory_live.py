"""The memory authority on a real ``residency serve`` started with no sizing flags: the pool sized
from measured memory, ``GET /admin/memory`` and ``ctl memory`` agreeing with the fold, and the
ledger holding the weights, every pinned grant (registered, then released at a clean stop) and
each move's dispatch. A start whose weights leave no room is refused with the arithmetic."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import ADMIN_KEY, MODEL, Server, read_ledger

pytestmark = pytest.mark.model


def chat(server: Server, text: str, session: str, max_tokens: int = 8) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0, "session_id": session})
    assert r.status_code == 200, r.text
    return r.json()


def ctl(server: Server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "residency.control.cli.main", "ctl", *args, "--db", server.ledger,
                           "--run-dir", str(server.dir / "run")], capture_output=True, text=True, timeout=120)


def folded_state(server: Server):
    from residency.control.state import decode_state
    from residency.events.asks import AskStatus
    from tests.control_plane.conftest import ServeClient

    return decode_state(ServeClient(server.dir / "run").ask(AskStatus(ask_id="t")).state)


def test_a_server_with_no_sizing_flags_serves_and_its_memory_view_matches_the_books(tmp_path):
    s = Server(tmp_path, "--park-after-s", "3600", device_blocks=None).wait_ready()
    try:
        chat(s, "Name three rivers.", "memo")
        r = s.admin("POST", "/admin/sessions/memo/park")
        assert r.status_code == 200, r.text
        view = s.admin("GET", "/admin/memory").json()
        state = folded_state(s)
        out = ctl(s, "memory", "--json")
        assert out.returncode == 0, out.stderr
        again = json.loads(out.stdout)
        text = ctl(s, "memory")
        assert s.admin("GET", "/admin/memory", key=None).status_code == 401
        assert s.admin("GET", "/admin/memory?probe_timeout_ms=0").status_code == 400
    finally:
        assert s.stop() == 0
    [w] = view["workers"]
    ws = state.workers[0]
    sizing = w["sizing"]
    # sized from measured memory: the arithmetic is there and its blocks are the pool's capacity
    assert sizing["how"] == "fraction" and sizing["total_bytes"] > 0 and sizing["in_use_bytes"] > 0
    assert sizing["num_blocks"] * w["block_bytes"] == ws.tiers["device"].capacity_bytes == w["tiers"]["device"]["kv_capacity_bytes"]
    assert sizing["budget_bytes"] - sizing["in_use_bytes"] - sizing["reserve_bytes"] >= sizing["pool_bytes"]
    for tier, tv in w["tiers"].items():
        beside = sum(ws.device_owned.values()) if tier == "device" else 0
        if tier == "host":
            beside = sum(v for k, v in ws.pinned.items() if k != "host-pool")
        assert tv["used_bytes"] == ws.tiers[tier].used_bytes + beside, tier
        ten = tv["tenants"]
        assert sum(v for k, v in ten.items() if k != "outside" and v is not None) + sum(ten["outside"].values()) == tv["used_bytes"]
        assert tv["reclaimable_bytes"] == tv["used_bytes"] - tv["hot_bytes"]
    assert w["tiers"]["device"]["tenants"]["weights"] == ws.device_owned["weights"] > 0
    assert w["tiers"]["host"]["tenants"]["session_kv"] > 0                      # the parked session
    assert w["tiers"]["host"]["pinned_bytes"] == sum(ws.pinned.values()) > 0
    assert w["probe"]["answered"] and w["probe"]["device_free_bytes"] > 0
    assert again["workers"][0]["tiers"] == w["tiers"]                            # nothing moved in between
    assert text.returncode == 0 and "reclaimable" in text.stdout and "worker 0" in text.stdout

    events, final = read_ledger(s.ledger)
    kinds = [type(r.event) for r in events]
    loaded = [r.event for r in events if type(r.event) is ev.WeightsLoaded]
    assert len(loaded) == 1 and loaded[0].model == MODEL and loaded[0].bytes == ws.device_owned["weights"]
    joined = [r.event for r in events if type(r.event) is ev.WorkerJoined]
    assert joined[0].device_owned["weights"] == loaded[0].bytes
    registered = {r.event.owner: r.event.bytes for r in events if type(r.event) is ev.PinnedRegistered}
    released = {r.event.owner: r.event.bytes for r in events if type(r.event) is ev.PinnedReleased}
    assert registered and registered == released == ws.pinned
    assert final.workers[0].pinned == {}
    assert kinds.index(ev.PinnedReleased) < kinds.index(ev.ServerStopped)
    park = [r for r in events if type(r.event) is ev.MoveRequested and r.event.kind == "park"]
    assert park
    seq_of = {(type(r.event), getattr(r.event, "move_id", None)): r.envelope.seq for r in events}
    mid = park[0].event.move_id
    assert seq_of[(ev.MoveRequested, mid)] < seq_of[(ev.MoveDispatched, mid)] < seq_of[(ev.MoveAcked, mid)]


def test_weights_that_cannot_fit_the_share_stop_serve_with_the_arithmetic(tmp_path):
    s = Server(tmp_path, "--gpu-memory-fraction", "0.001", device_blocks=None)
    try:
        rc = s.proc.wait(180)
    finally:
        s.stop()
    log = s.log_path.read_text(errors="replace")
    assert rc == 4, log[-3000:]
    line = [ln for ln in log.splitlines() if ln.startswith("residency serve: refused to start")]
    assert line, log[-3000:]
    assert "does not fit" in line[0] and "0.001 ×" in line[0] and "blocks" in line[0] and "GiB" in line[0]
    assert not (s.dir / "run" / "worker-0.pid").exists()


def test_diagnose_names_a_live_servers_pinned_bytes_over_the_host_ceiling(tmp_path):
    s = Server(tmp_path, "--park-after-s", "3600").wait_ready()
    try:
        out = ctl(s, "budget", "--tier", "host", "--ceiling", "64MiB")
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                type(r.event) is ev.BudgetSet for r in _events_live(s)):
            time.sleep(0.2)
    finally:
        assert s.stop() == 0
    out = subprocess.run([sys.executable, "-m", "residency.control.cli.main", "diagnose", "--db", s.ledger,
                          "--json"], capture_output=True, text=True, timeout=120)
    findings = json.loads(out.stdout)["findings"]
    pinned = [f for f in findings if f["detector"] == "pinned_over_budget"]
    assert pinned, findings
    assert pinned[0]["detail"]["budget_bytes"] == 64 << 20 and pinned[0]["detail"]["peak_bytes"] > 64 << 20


def _events_live(s: Server):
    """The ledger's events so far; none while serve has made the file but not yet its schema."""
    from residency.ledger import LedgerStore
    from residency.ledger.errors import NotALedger

    try:
        store = LedgerStore.open(s.ledger)
    except NotALedger:
        return []
    try:
        return list(store.read())
    finally:
        store.close()


def test_a_server_with_no_model_sizes_its_pool_too(tmp_path):
    env_fraction = "0.05"
    s = Server(tmp_path, "--model", "none", "--gpu-memory-fraction", env_fraction, device_blocks=None)
    try:
        deadline = time.monotonic() + 120
        joined = []
        while time.monotonic() < deadline and not joined:
            assert s.proc.poll() is None, s.tail()
            joined = [r.event for r in _events_live(s) if type(r.event) is ev.WorkerJoined] if os.path.exists(
                s.dir / "ledger.db") else []
            time.sleep(0.3)
    finally:
        assert s.stop() == 0
    assert joined and joined[0].tiers["device"] > 0 and joined[0].device_owned == {}
