"""``residency diagnose`` against a real ``residency serve`` driven into the wedges operators meet:
a control process killed with a request running, a worker frozen in the middle of a move, and
an operator swinging a session's pages off the device and back. Each test asserts the finding,
its cause and its onset from the ledger alone."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from residency.events import catalog as ev
from tests.serving.server import Server, read_ledger
from tests.serving.test_diagnose_live import chat, diagnose, ledger  # noqa: F401  (ledger: a fixture)

pytestmark = pytest.mark.model


def running(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("residency_requests_running "):
            return float(line.split()[1])
    raise AssertionError("no residency_requests_running metric")


def until(what: str, check, timeout_s: float = 60, server: Server | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}\n{server.tail() if server else ''}"
        time.sleep(0.2)


def rows(server: Server, kind) -> list:
    """Rows of one type recorded so far (the server may still be writing; reads only)."""
    from residency.ledger import LedgerStore
    store = LedgerStore.open(server.ledger)
    try:
        return [r for r in store.read(1, None) if type(r.event) is kind]
    finally:
        store.close()


def test_a_control_killed_with_a_request_running_is_named_a_crash_and_its_orphan_is_closed(tmp_path, ledger):
    s = Server(tmp_path, "--no-policies", ledger=ledger).wait_ready()
    out: dict = {}

    def long_generation() -> None:
        try:
            out["r"] = chat(s, "Tell me a long story about a ship.", 1500)
        except httpx.HTTPError as e:           # the control dies under it
            out["error"] = e

    t = threading.Thread(target=long_generation)
    t.start()
    until("the generation never ran", lambda: running(s) >= 1, server=s)
    until("no forward step was recorded", lambda: rows(s, ev.StepCompleted), server=s)
    os.killpg(s.proc.pid, signal.SIGKILL)       # the workers live in their own sessions: they survive
    s.proc.wait(10)
    s.log.close()
    t.join(60)
    assert "error" in out, out
    s.log_path.rename(s.dir / "serve-crashed.log")     # the surviving worker still writes there
    s2 = Server(tmp_path, "--no-policies", ledger=ledger).wait_ready()   # same run dir: it adopts
    try:
        until("the orphaned sequence was never cancelled",
              lambda: '"orphan_cancelled"' in s2.log_path.read_text(), server=s2)
        until("the orphan's pages were never freed",
              lambda: any(r.event.reason == "orphaned" for r in rows(s2, ev.BlocksFreed)), server=s2)
        again = chat(s2, "Hello again.", 8)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
        findings = diagnose(s2)
    finally:
        assert s2.stop() == 0
    events, state = read_ledger(s2.ledger)
    state.check_integrity()
    starts = [r for r in events if type(r.event) is ev.ServerStarted]
    assert len(starts) == 2 and not any(type(r.event) is ev.ServerStopped and r.seq < starts[1].seq for r in events)
    before = [r for r in events if r.seq < starts[1].seq]
    [orphan] = [r.event.request_id for r in before if type(r.event) is ev.RequestAdmitted]
    [closed] = [r for r in events if type(r.event) is ev.RequestFinished and r.event.request_id == orphan]
    assert closed.event.reason == "control_lost" and closed.seq > starts[1].seq
    freed = [r for r in events if type(r.event) is ev.BlocksFreed and r.event.reason == "orphaned"]
    assert freed and all(r.seq > closed.seq and r.envelope.correlation_id == orphan for r in freed)

    [crash] = [f for f in findings if f["detector"] == "crash"]
    assert crash["severity"] == "warning" and crash["subject"] == "control process"
    d = crash["detail"]
    # onset: the dead process's last forward step, taken for the request it left running
    last_step = [r for r in before if type(r.event) is ev.StepCompleted][-1]
    assert d["restart_seq"] == starts[1].seq and d["onset_seq"] == last_step.seq
    assert crash["onset_ns"] == last_step.envelope.ts_ns and crash["until_ns"] == starts[1].envelope.ts_ns
    assert {last_step.seq, starts[1].seq} <= set(crash["seqs"])
    assert d["adopted"] == [0] and d["rejoined"] == [] and d["lost"] == []
    assert d["num_orphaned"] == 1 and d["num_closed_by_recovery"] == 1 and d["never_closed"] == []
    assert "workers adopted: 0" in crash["title"] and "1 closed by recovery" in crash["title"]
    # the orphan is closed: nothing blames the idle, healthy server for it afterwards
    assert not [f for f in findings if f["detector"] in ("stall", "hole")], findings
    assert not [f for f in findings if f["severity"] == "critical"], findings


def test_a_worker_frozen_mid_move_is_named_silent_with_its_stranded_move_and_the_late_answer_closes_it(
        tmp_path, monkeypatch, ledger):
    # every move pauses 4 s half-way (copies begun, nothing committed); the process is stopped
    # inside that pause, so it answers neither the move nor pings: a worker frozen mid-move
    monkeypatch.setenv("RESIDENCY_WORKER_FAULTS", "exec_delay_ms=4000")
    s = Server(tmp_path, "--no-policies", "--move-deadline-s", "1", "--heartbeat-lost-s", "600", ledger=ledger,
               name="frozen").wait_ready()
    pid = int((s.dir / "run" / "worker-0.pid").read_text().split()[0])
    out: dict = {}
    try:
        assert chat(s, "Tell me about the sea. " * 8, 32, session="ice").status_code == 200
        t = threading.Thread(target=lambda: out.update(r=s.admin("POST", "/admin/sessions/ice/park")))
        t.start()
        until("the park was never requested", lambda: rows(s, ev.MoveRequested), server=s)
        time.sleep(1)                           # inside the worker's 4 s pause
        os.kill(pid, signal.SIGSTOP)
        try:
            until("the frozen move was never stranded", lambda: rows(s, ev.MoveStranded), server=s)
            until("the silence was never recorded", lambda: rows(s, ev.WorkerHeartbeatMissed), server=s)
            again = s.admin("POST", "/admin/sessions/ice/park")
            frozen = diagnose(s)
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(60)
        until("the stranding was never closed",
              lambda: rows(s, ev.MoveLateAcked) or rows(s, ev.MoveLateFailed), timeout_s=90, server=s)
        woke = diagnose(s)
    finally:
        assert s.stop() == 0
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    [req] = [r for r in events if type(r.event) is ev.MoveRequested and r.event.kind == "park"]
    [stranded] = [r for r in events if type(r.event) is ev.MoveStranded]
    [missed] = [r for r in events if type(r.event) is ev.WorkerHeartbeatMissed]
    [late] = [r for r in events if type(r.event) in (ev.MoveLateAcked, ev.MoveLateFailed)]
    mid = req.event.move_id
    assert req.event.session == "ice" and stranded.event.move_id == mid == late.event.move_id
    assert stranded.event.why == "deadline" and stranded.event.bytes_at_risk == req.event.bytes_planned > 0
    assert late.seq > stranded.seq
    # a second park names the stranded move that holds the session's pages, with its seq
    assert again.status_code == 409, again.text
    assert mid in again.text and "stranded" in again.text and f"seq {req.seq}" in again.text
    assert out["r"].status_code == 409 and mid in out["r"].text    # the first park never landed in time

    [silent] = [f for f in frozen if f["detector"] == "worker"]
    assert silent["subject"] == "worker 0" and silent["severity"] == "warning" and silent["until_ns"] is None
    assert silent["detail"]["stranded_moves"] == [mid]
    assert silent["detail"]["bytes_stranded"] == stranded.event.bytes_at_risk
    assert silent["onset_ns"] == missed.envelope.ts_ns - missed.event.silent_ms * 1_000_000
    assert {missed.seq, stranded.seq} <= set(silent["seqs"]) and mid in silent["title"]
    [at_risk] = [f for f in frozen if f["detector"] == "overdue_move"]
    assert at_risk["detail"]["oldest_move"] == mid and at_risk["detail"]["bytes_at_risk"] == stranded.event.bytes_at_risk
    assert at_risk["onset_ns"] == req.event.deadline_ns and req.seq in at_risk["seqs"]

    # awake, it answered: the stranding is closed, the silence over, nothing left at risk
    assert not [f for f in woke if f["severity"] in ("warning", "critical")], woke
    [episode] = [f for f in woke if f["detector"] == "worker"]
    assert episode["until_ns"] is not None
    if type(late.event) is ev.MoveLateAcked:
        [closed] = [f for f in woke if f["detector"] == "overdue_move"]
        assert closed["detail"]["worst_move"] == mid and late.seq in closed["seqs"]


def test_an_operator_parking_and_restoring_a_session_again_and_again_is_a_pendulum(tmp_path, ledger):
    s = Server(tmp_path, "--no-policies", ledger=ledger, name="swing").wait_ready()
    try:
        assert chat(s, "Tell me about the sea. " * 8, 32, session="yo").status_code == 200
        for _ in range(3):
            for action in ("park", "restore"):
                r = s.admin("POST", f"/admin/sessions/yo/{action}")
                assert r.status_code == 200, r.text
        findings = diagnose(s)
    finally:
        assert s.stop() == 0
    events, _ = read_ledger(s.ledger)
    moves = [r for r in events if type(r.event) is ev.MoveRequested and r.event.kind in ("park", "restore")]
    assert [r.event.kind for r in moves] == ["park", "restore"] * 3
    assert {r.envelope.causation for r in moves} == {"operator:park", "operator:restore"}
    [p] = [f for f in findings if f["detector"] == "pendulum"]
    assert p["severity"] == "warning" and p["subject"] == "worker 0" and p["until_ns"] is None
    d = p["detail"]
    assert d["asked_by"] == ["operator"] and d["sessions"] == ["yo"] and d["num_moves"] == 6
    assert d["bytes_moved"] == sum(r.event.bytes_planned for r in moves) > 0
    assert sorted(d["blocks"]) == sorted(moves[0].event.blocks)
    assert p["onset_ns"] == moves[0].envelope.ts_ns and moves[0].seq in p["seqs"]
    assert "asked by operator (6)" in p["title"]
