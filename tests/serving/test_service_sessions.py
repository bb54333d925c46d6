"""Sessions through the serving stack (tests/serving/stack.py): the list, parks of a parked
session, deletes recorded by the book and as the session's own, and a session that is busy."""
from __future__ import annotations

from residency.ledger import LedgerStore
from tests.serving.stack import BUSY, generating, stack  # noqa: F401 - stack: the fixture


def test_the_session_list_has_every_session_most_recent_first_with_its_tier(stack):
    s = stack()
    for name in ("older", "newer"):
        assert s.chat(f"hello from {name}", session=name, max_tokens=3).status_code == 200
    assert s.client.post("/admin/sessions/older/park", json={"tier": "disk"}).status_code == 200
    listed = s.client.get("/admin/sessions").json()
    assert listed["total"] == 2 and [x["session_id"] for x in listed["data"]] == ["newer", "older"]
    assert [x["tier"] for x in listed["data"]] == ["device", "disk"]
    assert listed["data"][1] == s.session("older")
    assert [x["session_id"] for x in s.client.get("/admin/sessions?limit=1").json()["data"]] == ["newer"]


def test_parking_a_parked_session_moves_nothing_and_says_so(stack):
    s = stack()
    assert s.chat("a turn to park " * 3, session="p", max_tokens=4).status_code == 200
    first = s.client.post("/admin/sessions/p/park").json()
    assert first["move_id"] is not None and first["note"] is None
    assert first["blocks_by_tier"] == {"device": 0, "host": first["num_blocks"], "disk": 0}
    again = s.client.post("/admin/sessions/p/park")
    assert again.status_code == 200 and again.json()["move_id"] is None
    assert again.json()["note"].startswith("nothing moved: no page of 'p' is on the device")
    assert s.client.post("/admin/sessions/p/restore").json()["note"] is None
    back = s.client.post("/admin/sessions/p/restore").json()
    assert back["move_id"] is None and "already on the device" in back["note"]


def test_deleting_a_session_frees_its_pages_on_every_tier_by_the_book(stack):
    s = stack(share_prefixes=False)       # "busy" must not restore a page of "gone" to share it
    assert s.chat("a first turn " * 3, session="gone", max_tokens=6).status_code == 200
    assert s.client.post("/admin/sessions/gone/park", json={"tier": "disk"}).status_code == 200
    assert s.chat("another", session="busy", max_tokens=3).status_code == 200
    held = s.session("gone")
    r = s.client.delete("/admin/sessions/gone")
    assert r.status_code == 200 and r.json()["bytes_freed"] == held["bytes"] > 0 and r.json()["tier"] == "disk"
    assert s.client.get("/admin/sessions/gone").status_code == 404
    again = s.chat("a first turn " * 3, session="gone", max_tokens=6).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and again["usage"]["restored_tokens"] == 0
    s.close()
    events, state = s.ledger()
    freed = [e for e in events if type(e).__name__ == "CopiesReleased" and e.tier == "disk"]
    assert sum(e.bytes for e in freed) == held["bytes"]
    asked = [e for e in events if type(e).__name__ == "MoveRequested" and "session gone deleted" in e.reason]
    assert asked and all(e.src == e.dst for e in asked)


def test_a_deleted_session_is_recorded_as_its_own_so_audit_timeline_and_status_see_it(stack):
    from residency.control.cli.audit_cmd import query
    from residency.control.timeline import timeline
    s = stack(share_prefixes=False)
    assert s.chat("a turn to delete " * 3, session="gone", max_tokens=6).status_code == 200
    assert s.client.post("/admin/sessions/gone/park").status_code == 200
    held = s.session("gone")
    assert s.client.delete("/admin/sessions/gone").json()["bytes_freed"] == held["bytes"]
    s.close()
    events, state = s.ledger()
    assert "gone" not in state.sessions                 # what `status` and `replay` list
    deleted = [e for e in events if type(e).__name__ == "SessionDeleted"]
    assert [(e.session, e.bytes_freed) for e in deleted] == [("gone", held["bytes"])]
    released = [e for e in events if type(e).__name__ == "CopiesReleased"]
    assert released and {e.session for e in released} == {"gone"}
    store = LedgerStore.open(s.url)
    try:
        totals, _ = query(store, "reclaimed", "session", None, None, 5)
        seen = [type(r.event).__name__ for r in timeline(store.read(), "session", "gone")]
    finally:
        store.close()
    by_session = {g: b for g, b, _ in totals}
    assert None not in by_session or by_session[None] == 0, totals
    assert by_session["gone"] >= 2 * held["bytes"]        # the park freed the device, the delete the host
    assert seen[-4:] == ["MoveRequested", "MoveDispatched", "CopiesReleased", "SessionDeleted"]


def test_a_session_generating_cannot_be_deleted(stack):
    s = stack(faults=BUSY)
    t, out = generating(s, "live")
    r = s.client.delete("/admin/sessions/live")
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
    t.join(30)
    assert out["r"].status_code == 200 and s.client.delete("/admin/sessions/live").status_code == 200
