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
    """kill -9 of the control and its worker: the restarted control gives the worker its adopt
    grace, then (it held disk copies) waits for the next incarnation's Hello instead of counting
    them lost, and keeps what that one found."""
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
    assert again["usage"]["restored_tokens"] == 32
    events, state = read_ledger(s2.ledger)
    state.check_integrity()
    [lost] = [r.event for r in events if type(r.event) is ev.WorkerLost]
    assert lost.reason.startswith("not back after the control restart") and lost.blocks_lost == []
    assert len(lost.kept_on_disk) == 3 and "worker_awaiting_replacement" in s2.log_path.read_text()
