"""Outside tenants against a real ``residency serve`` (SmolLM2 on CPU, SQLite): a reclaim parks
idle sessions and shrinks the device pool, an ask above everything reclaimable is refused whole,
undeclared tenants and bad sizes are refused by name, a release grows the pool back and the
server serves again; the ledger verifies and its replay equals the live state."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from residency.events import catalog as ev
from tests.serving.server import MODEL, Server


def _status(srv: Server):
    from residency.control.state import decode_state
    from residency.control.transport import AskClient, ask_endpoint
    from residency.events.asks import AskStatus
    from residency.events.handshake import key_in

    run_dir = srv.dir / "run"
    rep = AskClient(ask_endpoint(run_dir), timeout_s=30, key=key_in(run_dir)).ask(AskStatus(ask_id="t"))
    return rep, decode_state(rep.state)


def _ledger(srv: Server, through: int):
    from residency.control.replay import replay
    from residency.ledger import LedgerStore

    store = LedgerStore.open(srv.ledger)
    try:
        deadline = time.monotonic() + 20
        while store.last_seq() < through:
            assert time.monotonic() < deadline, "the ledger never caught up with the live state"
            time.sleep(0.05)
        state, _ = replay(store, through, use_snapshots=False)
        return [r.event for r in store.read(1, through)], state
    finally:
        store.close()


def _chat(srv: Server, text: str, session: str | None = None, max_tokens: int = 4):
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}
    if session:
        body["session_id"] = session
    return srv.admin("POST", "/v1/chat/completions", json=body)


def _ctl(srv: Server, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "residency.control.cli.main", "ctl", *argv, "--db", srv.ledger,
                           "--run-dir", str(srv.dir / "run")], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # --max-context 256: no reclaim leaves the pool less than one sequence of it, 16 pages of 16 tokens
    s = Server(tmp_path_factory.mktemp("tenants"), "--no-policies", "--tenant", "trainer",
               "--tenant", "judge=prefixes", "--retain-prefixes", "0", "--max-context", "256").wait_ready()
    yield s
    s.stop()


def test_a_reclaim_parks_idle_sessions_and_shrinks_the_pool_by_whole_pages(srv):
    for i in range(3):
        assert _chat(srv, f"Session {i}: tell me about the ledger of a memory server, please. " * 6,
                     session=f"idle-{i}").status_code == 200
    _, st = _status(srv)
    ws = st.workers[0]
    dev = ws.tiers["device"]
    bb = ws.block_bytes
    free = dev.capacity_bytes - dev.used_bytes
    ask = free + bb + 1                       # more than is free: pages must be emptied; not whole pages
    r = srv.admin("POST", "/admin/reclaim", json={"tenant": "trainer", "bytes": ask, "worker": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    granted = -(-ask // bb) * bb
    assert body["granted_bytes"] == granted and body["asked_bytes"] == ask
    assert body["measured_bytes"] is None             # a CPU host: not measured, never a guess
    assert body["sessions"] and all(s.startswith("idle-") for s in body["sessions"])
    assert body["freed_bytes"] >= 2 * bb              # the parks' acks said so
    rep, live = _status(srv)
    assert live.workers[0].tiers["device"].capacity_bytes == dev.capacity_bytes - granted
    assert live.workers[0].tenants == {"trainer": granted}
    events, replayed = _ledger(srv, rep.last_seq)
    kinds = [type(e).__name__ for e in events]
    mine = next(e for e in events if type(e) is ev.TenantReclaimed)
    assert mine.granted_bytes == granted and mine.rebind_id == body["rebind_id"] and mine.moves == body["moves"]
    assert "SessionParked" in kinds and "PoolResized" in kinds and "RebindCommitted" in kinds
    assert kinds.index("TenantReclaimed") > kinds.index("RebindCommitted") > kinds.index("SessionParked")
    assert replayed.state_hash() == rep.state_hash          # replay == live


def test_an_ask_above_everything_reclaimable_is_refused_whole_and_nothing_moves(srv):
    rep, st = _status(srv)
    before = [type(e).__name__ for e in _ledger(srv, rep.last_seq)[0]].count("MoveRequested")
    cap = st.workers[0].tiers["device"].capacity_bytes
    r = srv.admin("POST", "/admin/reclaim", json={"tenant": "trainer", "bytes": cap * 4})
    assert r.status_code == 409, r.text
    refusal = r.json()["refusal"]
    assert refusal["ask"] == "tenant:trainer" and refusal["asked_bytes"] >= cap * 4
    assert refusal["available_bytes"] < refusal["asked_bytes"]
    assert str(refusal["available_bytes"]) in refusal["reason"]
    rep2, st2 = _status(srv)
    events = _ledger(srv, rep2.last_seq)[0]
    assert [type(e).__name__ for e in events].count("MoveRequested") == before     # nothing moved
    assert st2.workers[0].tiers["device"].capacity_bytes == cap
    assert any(type(e) is ev.MoveRefused and e.ask == "tenant:trainer" for e in events)


def test_a_route_the_tenant_did_not_declare_is_not_used(srv):
    # judge may only drop retained prefixes, and this server retains none: only free pages count,
    # not the idle session that a park would empty
    assert _chat(srv, "An idle conversation judge may not park, about tiers. " * 3,
                 session="judge-idle").status_code == 200
    _, st = _status(srv)
    dev = st.workers[0].tiers["device"]
    r = srv.admin("POST", "/admin/reclaim",
                  json={"tenant": "judge", "bytes": dev.capacity_bytes - dev.used_bytes + st.workers[0].block_bytes})
    assert r.status_code == 409, r.text
    assert "prefixes 0" in r.json()["refusal"]["reason"]


@pytest.mark.parametrize("body, words", [
    ({"tenant": "intruder", "bytes": 4096}, "judge, trainer"),
    ({"tenant": "trainer", "bytes": 0}, "must be > 0"),
    ({"tenant": "trainer", "bytes": -5}, "must be > 0"),
    ({"tenant": "trainer", "bytes": "4GiB"}, "bytes"),
    ({"tenant": "trainer", "bytes": 4096, "worker": 7}, "worker 7"),
])
def test_a_bad_reclaim_is_refused_with_its_reason(srv, body, words):
    r = srv.admin("POST", "/admin/reclaim", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_ctl_names_the_declared_tenants_for_an_unknown_one(srv, capsys):
    from residency.control.cli.main import main

    # in this process: `python -m ...cli.main` runs main as __main__, whose UserError is not ctl's
    code = main(["ctl", "reclaim", "--tenant", "nobody", "--bytes", "1MiB", "--db", srv.ledger,
                 "--run-dir", str(srv.dir / "run")])
    assert code == 2
    assert "judge, trainer" in capsys.readouterr().err


def test_a_release_grows_the_pool_back_and_a_request_is_served(srv):
    _, st = _status(srv)
    held = st.workers[0].tenants.get("trainer")
    assert held, "the first test's grant"
    cap = st.workers[0].tiers["device"].capacity_bytes
    p = _ctl(srv, "release", "--tenant", "trainer")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "released by tenant trainer" in p.stdout and "not measured" in p.stdout
    rep, live = _status(srv)
    assert live.workers[0].tiers["device"].capacity_bytes == cap + held
    assert live.workers[0].tenants == {}
    assert _chat(srv, "Hello again", session="idle-0").status_code == 200
    again = srv.admin("POST", "/admin/release", json={"tenant": "trainer"})
    assert again.status_code == 400 and "holds nothing" in again.json()["error"]["message"]


def test_the_ledger_verifies_and_replays_to_the_live_state(srv):
    rep, _ = _status(srv)
    events, replayed = _ledger(srv, rep.last_seq)
    assert replayed.state_hash() == rep.state_hash
    replayed.check_integrity()
    names = {type(e).__name__ for e in events}
    assert {"TenantReclaimed", "TenantReleased", "MoveRefused"} <= names
    p = subprocess.run([sys.executable, "-m", "residency.control.cli.main", "ledger", "verify", "--db", srv.ledger],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_park_whose_answer_never_comes_is_named_stranded_and_nothing_is_granted(tmp_path, monkeypatch):
    # every move's outcome is dropped by the worker: the reclaim's park strands at its deadline
    monkeypatch.setenv("RESIDENCY_WORKER_FAULTS", "drop_ack=1")
    s = Server(tmp_path, "--no-policies", "--tenant", "trainer", "--retain-prefixes", "0",
               "--move-deadline-s", "1", "--max-context", "128").wait_ready()
    try:
        for name in ("quiet", "still"):         # the pool keeps 8 pages (the context floor): the park leaves more
            assert _chat(s, f"A conversation of {name} that will be parked, about ledgers and pages. " * 3,
                         session=name).status_code == 200
        _, st = _status(s)
        dev, bb = st.workers[0].tiers["device"], st.workers[0].block_bytes
        r = s.admin("POST", "/admin/reclaim",
                    json={"tenant": "trainer", "bytes": dev.capacity_bytes - dev.used_bytes + bb})
        assert r.status_code == 503, r.text
        failure = r.json()["failure"]
        assert failure["stranded_moves"] and failure["stranded_bytes"] > 0       # named, never counted as zero
        rep, live = _status(s)
        assert live.workers[0].tenants == {}
        assert live.workers[0].tiers["device"].capacity_bytes == dev.capacity_bytes     # the pool kept its size
        events, replayed = _ledger(s, rep.last_seq)
        failed = next(e for e in events if type(e) is ev.TenantReclaimFailed)
        stranded = [e for e in events if type(e) is ev.MoveStranded]
        assert failed.stranded_moves == [e.move_id for e in stranded][:len(failed.stranded_moves)]
        assert failed.stranded_bytes == sum(e.bytes_at_risk for e in stranded if e.move_id in failed.stranded_moves)
        assert replayed.state_hash() == rep.state_hash
    finally:
        s.stop()
