"""Prefixes shared across sessions and retained for requests outside a session, through the whole
serving stack (``test_service.Stack``: the real control process, worker and ledger, a tiny random
Llama): who reads or copies whose pages, what the ledger says, and that nothing is freed under a
reader."""
from __future__ import annotations

import threading
import time

from tests.serving.stack import P, stack  # noqa: F401 - the fixture

SYSTEM = {"role": "system", "content": "You are terse. Rules: one line, no lists, cite nothing. " * 2}


def test_a_new_session_starts_from_another_sessions_pages_and_owns_copies_of_them(stack):
    s = stack(device_blocks=160)
    a = s.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4).json()
    assert a["usage"]["shared_tokens"] == 0
    ask_b = [SYSTEM, {"role": "user", "content": "second question"}]
    b = s.chat(ask_b, session="b", max_tokens=8).json()
    lone = s.chat(ask_b, max_tokens=8).json()                     # outside a session: read in place
    u, ul = b["usage"], lone["usage"]
    opening = len("<system>" + SYSTEM["content"] + "<user>") // P * P
    assert u["shared_tokens"] == u["prompt_tokens_details"]["cached_tokens"] == opening
    # the same prompt again, outside a session: b's pages now hold all of it but its last token
    whole = (ul["prompt_tokens"] - 1) // P * P
    assert u["computed_tokens"] == u["prompt_tokens"] - opening and ul["shared_tokens"] == whole > opening
    off = stack(share_prefixes=False, device_blocks=160)
    off.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    ref = off.chat(ask_b, session="b", max_tokens=8).json()
    assert ref["usage"]["shared_tokens"] == 0 and ref["usage"]["computed_tokens"] == ref["usage"]["prompt_tokens"]
    assert b["choices"][0]["message"]["content"] == lone["choices"][0]["message"]["content"] \
        == ref["choices"][0]["message"]["content"]
    # the donor can be parked while b keeps its own copies on the device
    assert s.client.post("/admin/sessions/a/park", json={"tier": "host"}).status_code == 200
    assert s.session("b")["tier"] == "device" and s.session("a")["tier"] == "host"
    s.close()
    events, state = s.ledger()
    adm = {e.request_id: e for e in events if type(e).__name__ == "RequestAdmitted"}
    shared = [e for e in adm.values() if e.shared_tokens]
    assert [(e.session, e.shared_from, e.copied, e.shared_tokens) for e in shared] == \
        [("b", "a", True, opening), (None, "b", False, whole)]
    committed = {}
    for e in events:
        if type(e).__name__ == "BlocksCommitted" and e.tier == "device":
            for bid, key in zip(e.blocks, e.keys):
                committed[bid] = (e.session, key)
    donor = shared[0].shared_blocks
    b_pages = [bid for bid, (sess, _) in committed.items() if sess == "b"]
    assert len(donor) == opening // P and all(committed[bid][0] == "a" for bid in donor)
    assert not set(b_pages) & set(donor), "b owns copies, never a's pages"
    assert [committed[bid][1] for bid in b_pages[:len(donor)]] == [committed[bid][1] for bid in donor]


def test_a_donor_read_by_a_running_request_is_not_deleted_or_parked_under_it(stack, monkeypatch):
    s = stack(device_blocks=160)
    s.chat([SYSTEM, {"role": "user", "content": "first"}], session="a", max_tokens=4)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat([SYSTEM, {"role": "user", "content": "second"}],
                                                            max_tokens=100)))

    def reading() -> None:
        deadline = time.monotonic() + 10
        while not any(r.shared for r in s.service.workers.sched.running.values()):
            assert time.monotonic() < deadline
            time.sleep(0.001)

    t.start()
    reading()
    for r in (s.client.delete("/admin/sessions/a"), s.client.post("/admin/sessions/a/park", json={"tier": "host"})):
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_in_use", r.text
    t.join()
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["shared_tokens"] > 0
    # past the guard, the worker still refuses to free pages under a reader: the delete says so
    monkeypatch.setattr(type(s.service.book), "_not_read", lambda *a: None)
    t = threading.Thread(target=lambda: s.chat([SYSTEM, {"role": "user", "content": "third"}], max_tokens=100))
    t.start()
    reading()
    r = s.client.delete("/admin/sessions/a")
    t.join()
    assert r.status_code == 503 and r.json()["error"]["code"] == "release_failed", r.text
    assert s.client.delete("/admin/sessions/a").json()["bytes_freed"] > 0


def test_a_parked_donor_prefix_is_restored_for_it_and_shared(stack):
    s = stack(device_blocks=160, restore_policy="restore")
    s.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    assert s.client.post("/admin/sessions/a/park", json={"tier": "disk"}).status_code == 200
    ask_b = [SYSTEM, {"role": "user", "content": "second question"}]
    b = s.chat(ask_b, session="b", max_tokens=8).json()
    u = b["usage"]
    opening = len("<system>" + SYSTEM["content"] + "<user>") // P * P
    assert u["shared_tokens"] == u["restored_tokens"] == opening
    assert u["computed_tokens"] == u["prompt_tokens"] - opening
    off = stack(share_prefixes=False, device_blocks=160)
    off.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    assert off.chat(ask_b, session="b", max_tokens=8).json()["choices"] == b["choices"]
    assert s.session("a")["tier"] == "disk", "a's pages past the shared prefix stay where they were"
    s.close()
    events, _ = s.ledger()
    restores = [e for e in events if type(e).__name__ == "MoveRequested" and e.kind == "restore"]
    assert [(e.session, len(e.blocks)) for e in restores] == [("a", opening // P)]
    assert [e.session for e in events if type(e).__name__ == "SessionRestored"] == ["a"]



def test_a_request_outside_a_session_is_retained_for_the_prompts_that_open_like_it(stack):
    s = stack(device_blocks=160, retain_fraction=0.5)
    first = [SYSTEM, {"role": "user", "content": "first question"}]
    r1 = s.chat(first, max_tokens=6).json()
    r2 = s.chat([SYSTEM, {"role": "user", "content": "another one"}], max_tokens=6).json()
    opening = len("<system>" + SYSTEM["content"] + "<user>") // P * P
    assert r1["usage"]["shared_tokens"] == 0 and r2["usage"]["shared_tokens"] == opening
    # the first conversation goes on without a session: it continues the retained pages
    nxt = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "and then?"}]
    r3 = s.chat(nxt, max_tokens=6).json()
    assert r3["usage"]["shared_tokens"] == 0
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] > opening
    listed = s.client.get("/admin/sessions").json()["data"]
    assert [d["session_id"] for d in listed] == [f"~{r1['id']}"] and listed[0]["tier"] == "device"
    s.close()
    events, _ = s.ledger()
    adm = [(e.session, e.shared_from) for e in events if type(e).__name__ == "RequestAdmitted"]
    assert adm == [(f"~{r1['id']}", None), (None, f"~{r1['id']}"), (f"~{r1['id']}", None)]


def test_retained_prefixes_past_their_budget_are_evicted_by_the_book(stack):
    s = stack(device_blocks=160, retain_fraction=0.001)      # under one prefix's bytes: each is evicted
    r = s.chat([SYSTEM, {"role": "user", "content": "a question"}], max_tokens=4).json()
    deadline = time.monotonic() + 10
    while s.client.get("/admin/sessions").json()["total"]:
        assert time.monotonic() < deadline, "the retained prefix was never evicted"
        time.sleep(0.02)
    s.close()
    events, state = s.ledger()
    asked = [e for e in events if type(e).__name__ == "MoveRequested" and "retained prefix" in e.reason]
    assert asked and all(e.src == e.dst == "device" for e in asked) and f"~{r['id']}" in asked[0].reason
    freed = [e for e in events if type(e).__name__ == "CopiesReleased"]
    assert sum(e.bytes for e in freed) > 0 and not state.blocks.get(0)
