"""Sessions parked to disk survive a clean restart of ``residency serve`` (``--keep-disk``, its
default): the stop keeps the disk copies in the ledger and on disk, the new worker rebuilds its
disk index from the files and verifies each, and the control keeps those the ledger has there
(``WorkerLost.kept_on_disk``). A file that fails verification is named lost; the next turn of its
session recomputes from that page on."""
from __future__ import annotations

import httpx
import pytest

from residency.events import catalog as ev
from residency.dataplane.pools.disk import HEADER_BYTES
from tests.serving.server import MODEL, Server, read_ledger

pytestmark = pytest.mark.model

TURN1 = [{"role": "user", "content": "What is the capital of France?"}]


def chat(server: Server, messages, session: str) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, "session_id": session})
    assert r.status_code == 200, r.text
    return r.json()


def turn2(first: dict) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And the capital of Italy?"}]


def _restored_after_a_dead_worker_was_replaced(server: Server, again: dict):
    """The session's three parked pages came back from disk, and the one loss in the ledger is of a
    worker started before this control, keeping those pages."""
    assert again["usage"]["restored_tokens"] == 32
    events, state = read_ledger(server.ledger)
    state.check_integrity()
    [lost] = [r.event for r in events if type(r.event) is ev.WorkerLost]
    assert lost.reason.startswith("worker process exited (started before this control") and lost.blocks_lost == []
    assert len(lost.kept_on_disk) == 3
    return lost, state


def test_sessions_parked_to_disk_survive_a_clean_restart_and_a_bad_file_is_named_lost(tmp_path):
    s = Server(tmp_path, "--park-after-s", "600").wait_ready()
    try:
        first = {name: chat(s, TURN1, name) for name in ("alice", "bob")}
        for name in ("alice", "bob"):
            r = s.admin("POST", f"/admin/sessions/{name}/park", json={"tier": "disk"})
            assert r.status_code == 200 and r.json()["tier"] == "disk", r.text
        pages = {name: s.admin("GET", f"/admin/sessions/{name}").json()["num_blocks"] for name in ("alice", "bob")}
    finally:
        assert s.stop() == 0
    events, state = read_ledger(s.ledger)
    on_disk = sorted(b for b, st in state.blocks[0].items() if st.tiers == ["disk"])
    assert len(on_disk) == sum(pages.values()) and type(events[-1].event) is ev.ServerStopped
    bob = sorted(b for b, st in state.blocks[0].items() if st.session == "bob")
    disk_dir = s.dir / "run" / "disk-0"
    assert sorted(int(p.name.split("-")[1].split(".")[0]) for p in disk_dir.glob("block-*.kv")) == on_disk
    with open(disk_dir / f"block-{bob[1]}.kv", "r+b") as f:        # bob's second page rots on disk
        f.seek(HEADER_BYTES + 1001)
        flipped = bytes([f.read(1)[0] ^ 0x04])
        f.seek(HEADER_BYTES + 1001)
        f.write(flipped)

    s2 = Server(tmp_path, "--park-after-s", "600").wait_ready()    # same ledger, same run dir
    try:
        a2, b2 = chat(s2, turn2(first["alice"]), "alice"), chat(s2, turn2(first["bob"]), "bob")
        ref = chat(s2, turn2(first["alice"]), "never-moved")
        scraped = httpx.get(f"{s2.url}/metrics", timeout=30).text
    finally:
        assert s2.stop() == 0
    assert a2["usage"]["restored_tokens"] == 32 and a2["choices"][0]["message"] == ref["choices"][0]["message"]
    assert b2["usage"]["restored_tokens"] == 16 and b2["choices"][0]["message"] == ref["choices"][0]["message"]
    events, state = read_ledger(s2.ledger)
    state.check_integrity()
    lost = [r.event for r in events if type(r.event) is ev.WorkerLost]
    assert len(lost) == 1 and lost[0].reason.startswith("stopped with the server")
    assert lost[0].blocks_lost == [bob[1]] and lost[0].kept_on_disk == [b for b in on_disk if b != bob[1]]
    assert lost[0].bytes_kept == len(lost[0].kept_on_disk) * state.workers[0].block_bytes
    kept = next(line for line in scraped.splitlines() if line.startswith("residency_disk_kept_bytes_total "))
    assert float(kept.split()[1]) == lost[0].bytes_kept
    assert f"block-{bob[1]}.kv" in s2.log_path.read_text()         # the quarantined file, named in the log


def test_without_keep_disk_a_clean_stop_frees_the_disk_copies_and_the_next_turn_recomputes(tmp_path):
    s = Server(tmp_path, "--park-after-s", "600", "--no-keep-disk").wait_ready()
    try:
        first = chat(s, TURN1, "carol")
        assert s.admin("POST", "/admin/sessions/carol/park", json={"tier": "disk"}).status_code == 200
    finally:
        assert s.stop() == 0
    _, state = read_ledger(s.ledger)
    assert not state.blocks.get(0) and state.tier(0, "disk").used_bytes == 0
    s2 = Server(tmp_path, "--park-after-s", "600", "--no-keep-disk").wait_ready()
    try:
        again = chat(s2, turn2(first), "carol")
    finally:
        assert s2.stop() == 0
    assert again["usage"]["restored_tokens"] == 0 and not list((s.dir / "run" / "disk-0").glob("block-*.kv"))


def test_after_a_crash_of_every_process_the_disk_copies_wait_for_the_new_worker_and_are_kept(tmp_path):
    """kill -9 of the control and its worker: the restarted control sees the worker's process is
    gone (its pid file) without waiting out the adopt grace, then (it held disk copies) waits for
    the next incarnation's Hello instead of counting them lost, and keeps what that one found."""
    import os
    import signal
    s = Server(tmp_path, "--park-after-s", "600").wait_ready()
    first = chat(s, TURN1, "dora")
    assert s.admin("POST", "/admin/sessions/dora/park", json={"tier": "disk"}).status_code == 200
    worker_pid = int((s.dir / "run" / "worker-0.pid").read_text().split()[0])
    os.killpg(s.proc.pid, signal.SIGKILL)
    os.kill(worker_pid, signal.SIGKILL)
    s.proc.wait(10)
    s.log.close()
    s2 = Server(tmp_path, "--park-after-s", "600").wait_ready()
    try:
        again = chat(s2, turn2(first), "dora")
    finally:
        assert s2.stop() == 0
    lost, _ = _restored_after_a_dead_worker_was_replaced(s2, again)
    assert "worker_awaiting_replacement" in s2.log_path.read_text()


def test_after_a_kill_of_the_worker_alone_its_replacement_keeps_the_disk_copies_and_the_session_restores(tmp_path):
    """kill -9 of the worker only: the control waits for the next incarnation's Hello before
    recording the loss, keeps the files that one verified, and the session's next turn reads them.
    The request running on the killed worker is answered at once, not after that wait (prefix
    sharing off: that request would otherwise restore one of the parked pages for itself)."""
    import json
    import os
    import signal
    import threading
    import time
    s = Server(tmp_path, "--park-after-s", "600", "--no-share-prefixes").wait_ready()
    long: dict = {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a ship."}],
            "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    running = threading.Thread(target=lambda: long.update(r=httpx.post(f"{s.url}/v1/chat/completions", json=body,
                                                                        timeout=120)))
    try:
        first = chat(s, TURN1, "erin")
        assert s.admin("POST", "/admin/sessions/erin/park", json={"tier": "disk"}).status_code == 200
        running.start()
        deadline = time.monotonic() + 60
        while "residency_requests_running 1.0" not in httpx.get(f"{s.url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline and running.is_alive(), long
            time.sleep(0.05)
        pid_file = s.dir / "run" / "worker-0.pid"
        old_pid = int(pid_file.read_text().split()[0])
        os.kill(old_pid, signal.SIGKILL)
        running.join(120)
        assert long["r"].status_code >= 500, long["r"].text
        deadline = time.monotonic() + 180
        while int(pid_file.read_text().split()[0]) == old_pid:       # the supervisor starts the next one
            assert time.monotonic() < deadline, s.tail()
            time.sleep(0.2)
        s.wait_ready()                                              # it said ServingReady (after its Hello)
        again = chat(s, turn2(first), "erin")
        ref = chat(s, turn2(first), "never-moved")
    finally:
        assert s.stop() == 0
    assert again["usage"]["restored_tokens"] == 32
    assert again["choices"][0]["message"] == ref["choices"][0]["message"]
    events, state = read_ledger(s.ledger)
    state.check_integrity()
    [lost] = [r for r in events if type(r.event) is ev.WorkerLost]
    [ended] = [r for r in events if type(r.event) is ev.RequestFinished and r.event.reason == "error"]
    assert ended.seq < lost.seq                                     # answered before the replacement came
    before = [r.event for r in events if r.seq < lost.seq and type(r.event) is ev.BlocksCommitted]
    erin = sorted(b for e in before if e.session == "erin" for b in e.blocks)
    running_pages = {b for e in before if e.session is None for b in e.blocks}   # if its prefill ran
    lost = lost.event
    assert lost.reason.startswith("worker process exited with code -9")
    assert len(erin) == 3 and lost.kept_on_disk == erin and set(lost.blocks_lost) <= running_pages
    assert lost.bytes_kept == 3 * state.workers[0].block_bytes
    claims = [json.loads(line) for line in s.log_path.read_text().splitlines() if '"disk_claimed"' in line]
    assert [(c["kept"], c["dropped"]) for c in claims] == [(3, 0)]


def test_a_worker_adopted_after_a_control_crash_and_then_killed_keeps_its_disk_copies(tmp_path):
    """kill -9 of the control; the restarted control adopts the surviving worker; then kill -9 of
    that worker. It is not the new supervisor's child, yet its exit is seen (its pid file's process
    is gone), so its disk copies wait for the next incarnation and are kept, not dropped after a
    heartbeat silence; the session's next turn reads them."""
    import json
    import os
    import signal
    import time
    s = Server(tmp_path, "--park-after-s", "600").wait_ready()
    first = chat(s, TURN1, "fern")
    assert s.admin("POST", "/admin/sessions/fern/park", json={"tier": "disk"}).status_code == 200
    pid_file = s.dir / "run" / "worker-0.pid"
    old_pid = int(pid_file.read_text().split()[0])
    os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    s.log.close()
    s2 = Server(tmp_path, "--park-after-s", "600").wait_ready()    # the same worker, adopted
    try:
        assert int(pid_file.read_text().split()[0]) == old_pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while int(pid_file.read_text().split()[0]) == old_pid:     # the supervisor starts the next one
            assert time.monotonic() < deadline, s2.tail()
            time.sleep(0.2)
        s2.wait_ready()
        again = chat(s2, turn2(first), "fern")
    finally:
        assert s2.stop() == 0
    lost, state = _restored_after_a_dead_worker_was_replaced(s2, again)
    assert lost.bytes_kept == 3 * state.workers[0].block_bytes
    claims = [json.loads(line) for line in s2.log_path.read_text().splitlines() if '"disk_claimed"' in line]
    assert [(c["kept"], c["dropped"]) for c in claims] == [(3, 0)]
