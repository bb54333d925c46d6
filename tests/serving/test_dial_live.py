"""The dial on a real ``residency serve`` (embedded model, SQLite): the device pool shrunk and grown
live while sessions hold pages and a stream runs, refusals with their arithmetic, a torn rebind
that closes the pool until a complete resize repairs it, and the context floor (no shrink below
one sequence of the whole context but a sleep's; a request the pool cannot hold answered at
once). The ledger tells all of it."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from residency.control.state import state_hash
from residency.events import catalog as ev
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "residency.control.cli.main"]


def chat(server: Server, text: str, max_tokens: int, session: str | None = None, timeout: float = 180) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    if session:
        body["session_id"] = session
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def metric(server: Server, name: str, **labels) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if metric_name != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if all(have.get(k, "").strip('"') == str(v) for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no metric {name} {labels}")


def device_bytes(server: Server) -> int:
    return int(metric(server, "residency_tier_capacity_bytes", worker="0", tier="device"))


def ctl_resize(server: Server, nbytes: int | str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ctl", "resize", "--db", server.ledger, "--run-dir", str(server.dir / "run"),
                           "--worker", "0", "--tier", "device", "--bytes", str(nbytes), "--json"],
                          capture_output=True, text=True, timeout=120)


def resize(server: Server, nbytes: int, tier: str = "device") -> httpx.Response:
    return server.admin("POST", "/admin/resize", json={"worker": 0, "tier": tier, "bytes": nbytes})


def check_replay_is_live(server: Server) -> None:
    """The live state's hash (the status ask) equals a replay of the ledger through the same seq."""
    from residency.control.replay import replay
    from residency.events.asks import AskStatus
    from residency.ledger import LedgerStore
    from tests.control_plane.conftest import ServeClient

    status = ServeClient(server.dir / "run").ask(AskStatus(ask_id="st", include_state=False))
    store = LedgerStore.open(server.ledger)
    try:
        state, _ = replay(store, to_seq=status.last_seq, use_snapshots=False)
    finally:
        store.close()
    assert state_hash(state) == status.state_hash


def verify(server: Server) -> None:
    out = subprocess.run([*CLI, "ledger", "verify", "--db", server.ledger], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_device_pool_shrinks_and_grows_live_under_sessions_and_a_stream(tmp_path):
    # pages stay until the dial moves them; --max-context 512: one sequence of the whole context is
    # 32 pages of 16 tokens, under the quarter of the pool the shrink leaves
    s = Server(tmp_path, "--drain-s", "0", "--park-after-s", "600", "--max-context", "512", name="dial").wait_ready()
    try:
        story = "Write a long story about a lighthouse keeper and the sea. "
        before = text_of(chat(s, story, 120))                    # the reference, no resize near it
        for i in range(4):                                       # idle sessions holding device pages
            assert chat(s, f"Session {i}: " + "Tell me about rivers and the sea. " * 30, 8,
                        session=f"s{i}").status_code == 200
        full = device_bytes(s)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=chat(s, story, 120)))
        t.start()
        deadline = time.monotonic() + 60
        while metric(s, "residency_requests_running") < 1:       # the stream is running
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.05)
        shrunk = full // 4
        done = ctl_resize(s, shrunk)
        assert done.returncode == 0, done.stdout + done.stderr
        kinds = [e["type"] for e in json.loads(done.stdout)["events"]]
        assert "MoveAcked" in kinds or "CopiesReleased" in kinds      # live pages left the released range
        assert kinds[-1] == "RebindCommitted" and "PoolResized" in kinds
        assert device_bytes(s) <= shrunk
        grown = resize(s, full)
        assert grown.status_code == 200 and grown.json()["outcome"] == "committed", grown.text
        t.join(180)
        assert text_of(out["r"]) == before                       # greedy: a resize is placement, never numerics
        assert text_of(chat(s, story, 120)) == before
        for i in range(4):                                       # an evicted session's next turn still serves
            assert chat(s, "And then?", 8, session=f"s{i}").status_code == 200
        check_replay_is_live(s)
    finally:
        s.stop()
    events, _ = read_ledger(s.ledger)
    reqs = [r.event for r in events if type(r.event) is ev.RebindRequested]
    assert len(reqs) == 2 and "scheduler" in reqs[0].readers and len(reqs[0].readers) >= 3
    for req in reqs:
        stamped = {r.event.reader for r in events if type(r.event) is ev.ReaderStamped
                   and r.event.rebind_id == req.rebind_id}
        assert stamped == set(req.readers)
        assert any(type(r.event) is ev.RebindCommitted and r.event.rebind_id == req.rebind_id for r in events)
    sizes = [(r.event.from_bytes, r.event.to_bytes) for r in events if type(r.event) is ev.PoolResized]
    assert sizes[0][1] < sizes[0][0] and sizes[1][1] > sizes[1][0]
    verify(s)


def test_refusals_change_nothing_and_a_torn_pool_waits_until_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("RESIDENCY_WORKER_FAULTS", "miss_stamp=mover")
    s = Server(tmp_path, "--drain-s", "0", "--max-context", "512", name="torn").wait_ready()
    try:
        full = device_bytes(s)
        # not a resize: another tier, a bad body
        r = resize(s, 1 << 20, tier="host")
        assert r.status_code == 400 and "only the device pool" in r.json()["error"]["message"]
        assert s.admin("POST", "/admin/resize", json={"worker": 0, "bytes": "lots"}).status_code == 400
        # below the floor: refused with its arithmetic, nothing changes
        budget = subprocess.run([*CLI, "ctl", "budget", "--db", s.ledger, "--run-dir", str(s.dir / "run"),
                                 "--worker", "0", "--tier", "device", "--floor", str(full // 2)],
                                capture_output=True, text=True, timeout=60)
        assert budget.returncode == 0, budget.stderr
        r = resize(s, full // 4)
        assert r.status_code == 409 and r.json()["outcome"] == "refused"
        refused = r.json()["events"][0]
        assert refused["type"] == "MoveRefused" and refused["floor_bytes"] >= full // 2
        assert "budget floor" in refused["reason"]
        assert device_bytes(s) == full
        # the worker's mover misses its stamp: the pool is torn
        r = resize(s, full)
        assert r.status_code == 503 and r.json()["outcome"] == "torn", r.text
        torn = [e for e in r.json()["events"] if e["type"] == "RebindTorn"][0]
        assert torn["readers_behind"] == ["mover"]
        health = httpx.get(f"{s.url}/health", timeout=10)
        assert health.status_code == 503 and torn["rebind_id"] in json.dumps(health.json())
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=chat(s, "Hello there", 8)))
        t.start()
        deadline = time.monotonic() + 30
        while metric(s, "residency_requests_waiting") < 1:       # it waits: nothing is placed on a torn pool
            assert time.monotonic() < deadline, "the request never waited"
            time.sleep(0.2)
        diag = subprocess.run([*CLI, "diagnose", "--db", s.ledger, "--at", "now", "--json"], capture_output=True,
                              text=True, timeout=120, check=True)
        findings = [f for f in json.loads(diag.stdout)["findings"] if f["detector"] == "torn_rebind"]
        assert findings and findings[0]["severity"] == "critical"
        assert findings[0]["detail"]["rebind_id"] == torn["rebind_id"]
        # a rebind in place repairs it; the waiting request is served
        r = resize(s, full)
        assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
        t.join(120)
        assert out["r"].status_code == 200, out["r"].text
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
        check_replay_is_live(s)
    finally:
        s.stop()
    verify(s)


def test_no_shrink_goes_below_one_sequence_of_the_context_but_a_sleep_and_too_long_a_request_is_answered(tmp_path):
    # pages of 16 tokens and --max-context 512: one sequence of the whole context is 32 pages; the
    # pool starts at 8 (--device-blocks), below that
    s = Server(tmp_path, "--drain-s", "0", "--max-context", "512", name="ctx", device_blocks=8).wait_ready()
    try:
        bb = device_bytes(s) // 8
        # a request the pool can never hold is answered now, with its arithmetic, never held
        r = chat(s, "Tell me a story about the sea.", 120, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_kv_capacity", r.text
        said = r.json()["error"]["message"]
        assert "max_tokens 120" in said and "page_tokens 16" in said and "its limit is 8 pages" in said, said
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)     # no max_tokens: the context's rest
        assert r.status_code == 503 and "its limit is 8 pages" in r.json()["error"]["message"], r.text
        assert chat(s, "Hello", 8).status_code == 200                            # what fits is served
        # a shrink below the context floor is refused with its arithmetic; in place and grows pass
        r = resize(s, 4 * bb)
        assert r.status_code == 409 and r.json()["outcome"] == "refused", r.text
        [refused] = r.json()["events"]
        assert refused["type"] == "MoveRefused" and refused["floor_bytes"] == 32 * bb
        assert "ceil(max_context 512 / page_tokens 16) = 32 pages" in refused["reason"], refused
        assert device_bytes(s) == 8 * bb
        for pages in (8, 32):
            r = resize(s, pages * bb)
            assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
        assert text_of(chat(s, "Tell me a story about the sea.", 120))           # it fits now
        r = resize(s, 31 * bb)
        assert r.status_code == 409 and "context floor" in r.json()["events"][0]["reason"], r.text
        # a sleep is the one shrink below it (the model leaves with it), and its wake grows the pool back
        slept = s.admin("POST", "/sleep?level=1")
        assert slept.status_code == 200 and slept.json()["outcome"] == "completed", slept.text
        assert [(k["resized"], k["to_bytes"]) for k in slept.json()["kv_pool"]] == [(True, bb)], slept.text
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(r=chat(s, "Tell me a story about the sea.", 120)))
        t.start()                   # held for the wake, never seated on (or refused by) the one-page pool
        time.sleep(1.0)
        assert t.is_alive(), out
        woke = s.admin("POST", "/wake_up")
        assert woke.status_code == 200 and woke.json()["outcome"] == "completed", woke.text
        assert [(k["resized"], k["to_bytes"]) for k in woke.json()["kv_pool"]] == [(True, 32 * bb)], woke.text
        t.join(180)
        assert text_of(out["r"])
        check_replay_is_live(s)
    finally:
        s.stop()
    events, _ = read_ledger(s.ledger)
    refusals = [r.event for r in events if type(r.event) is ev.MoveRefused and "context floor" in r.event.reason]
    assert [e.asked_bytes for e in refusals] == [4 * bb, 31 * bb]
    verify(s)
