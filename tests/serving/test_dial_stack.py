"""The dial through the HTTP API on the serving stack (tiny model, real control, real worker over
ZMQ): a resize answered with its events, greedy output unchanged by it, and a torn pool whose
requests wait and are answered 503 ``pool_torn`` until a rebind in place repairs it."""
from __future__ import annotations

from residency.control.state import state_hash
from residency.events import catalog as ev
from tests.serving.stack import names, stack  # noqa: F401  (fixture)


def block_bytes(s) -> int:
    return s.proc.call(lambda p: p.state.workers[0].block_bytes).result(5)


def resize(s, nbytes: int):
    return s.client.post("/admin/resize", json={"worker": 0, "tier": "device", "bytes": nbytes})


def live_equals_replay(s) -> None:
    live = s.proc.call(lambda p: (p.state.last_seq, state_hash(p.state))).result(5)
    from residency.control.replay import replay
    state, _ = replay(s.store, to_seq=live[0], use_snapshots=False)
    assert state_hash(state) == live[1]


def test_a_resize_through_the_api_keeps_greedy_output_and_a_torn_pool_answers_pool_torn(stack):
    s = stack(device_blocks=64, max_context=96)       # the context floor: 96 / 4 = 24 pages
    bb = block_bytes(s)
    before = s.chat("the same words every time", max_tokens=12).json()["choices"][0]["message"]["content"]
    assert s.chat("a session's turn", session="s1", max_tokens=8).status_code == 200
    r = resize(s, 24 * bb + bb // 2)
    assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
    kinds = [e["type"] for e in r.json()["events"]]
    assert kinds[0] == "RebindRequested" and kinds[-2:] == ["ReaderStamped", "RebindCommitted"]
    req = r.json()["events"][0]
    stamped = {e["reader"] for e in r.json()["events"] if e["type"] == "ReaderStamped"}
    assert stamped == set(req["readers"]) and "scheduler" in stamped and "serving" in stamped
    resized = [e for e in r.json()["events"] if e["type"] == "PoolResized"][0]
    assert (resized["from_bytes"], resized["to_bytes"]) == (64 * bb, 24 * bb)
    after = s.chat("the same words every time", max_tokens=12).json()["choices"][0]["message"]["content"]
    assert after == before
    assert s.chat("and the next turn", session="s1", max_tokens=8).status_code == 200

    s.worker.core.faults.miss_stamp = "serving"          # the next rebind leaves the serving loop behind
    r = resize(s, 24 * bb)                                # in place
    assert r.status_code == 503 and r.json()["outcome"] == "torn", r.text
    torn = r.json()["events"][-1]
    assert torn["type"] == "RebindTorn" and torn["readers_behind"] == ["serving"]
    health = s.client.get("/health")
    assert health.status_code == 503 and torn["rebind_id"] in str(health.json()["problems"])
    waited = s.chat("nothing is placed on a torn pool", max_tokens=4)      # waits, then the wait times out
    assert waited.status_code == 503 and waited.json()["error"]["code"] == "pool_torn"
    assert torn["rebind_id"] in waited.json()["error"]["message"]

    r = resize(s, 24 * bb)                                # a complete rebind in place repairs it
    assert r.status_code == 200 and r.json()["outcome"] == "committed", r.text
    assert s.client.get("/health").status_code == 200
    again = s.chat("the same words every time", max_tokens=12).json()["choices"][0]["message"]["content"]
    assert again == before
    live_equals_replay(s)
    events, state = s.ledger()
    assert names(events).count("RebindCommitted") == 2 and names(events).count("RebindTorn") == 1
    assert state.workers[0].tiers["device"].capacity_bytes == 24 * bb
    queued = [e for e in events if type(e) is ev.RequestQueued and e.waiting_for.startswith("the device pool")]
    assert queued and torn["rebind_id"] in queued[0].waiting_for


def test_bad_resize_bodies_are_answered_400_with_the_reason(stack):
    s = stack(device_blocks=16)
    for body, why in (({"worker": 0, "tier": "disk", "bytes": 1 << 20}, "only the device pool"),
                      ({"worker": 0, "bytes": 1}, "less than one block"),
                      ({"worker": 0, "bytes": "6GiB"}, "bytes"),
                      ({"worker": 9, "bytes": 1 << 20}, "worker 9"),
                      ({"worker": 0, "bytes": 1 << 20, "extra": 1}, "extra")):
        r = s.client.post("/admin/resize", json=body)
        assert r.status_code == 400, (body, r.text)
        assert why in r.text, (body, r.text)
    events, _ = s.ledger()
    assert not [e for e in events if type(e).__name__.startswith("Rebind") or type(e) is ev.MoveRefused]


def test_a_resize_above_what_the_machine_holds_is_refused_by_the_worker_and_changes_nothing(stack):
    s = stack(device_blocks=16)
    bb = block_bytes(s)
    r = resize(s, 1 << 50)
    assert r.status_code == 409 and r.json()["outcome"] == "refused", r.text
    kinds = [e["type"] for e in r.json()["events"]]
    assert kinds == ["RebindRequested", "RebindRefused"]
    assert "does not fit" in r.json()["events"][-1]["error"]
    assert s.client.get("/health").status_code == 200          # refused, not torn: the pool serves on
    assert s.chat("still serving", max_tokens=4).status_code == 200
    events, state = s.ledger()
    assert state.workers[0].tiers["device"].capacity_bytes == 16 * bb
    assert [e.status for e in state.rebinds.values()] == ["refused"]
    live_equals_replay(s)
