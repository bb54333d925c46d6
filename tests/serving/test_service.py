"""The serving stack without SmolLM2: a tiny random Llama behind the real pieces.

    TestClient ─► create_app ─► ServingService ─► ControlProc (ledger) ─ZMQ─► WorkerProc (thread)
                                                                          WorkerCore + Mover + ServingLoop

Everything but the model and the tokenizer is what ``residency serve`` runs, so admission waits,
parks of idle sessions, refusals, busy sessions and restore-or-recompute are exercised in seconds.
"""
from __future__ import annotations

import threading
import time

import pytest

from residency.control.policy import PolicyConfig
from tests.serving.server import read_ledger
from tests.serving.stack import BUSY, P, ByteTokenizer, Stack, generating, names, stack  # noqa: F401 - stack: the fixture


def test_a_chat_runs_through_the_whole_stack_and_is_recorded(stack):
    s = stack()
    r = s.chat("hello there", max_tokens=5)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == 5 and u["prompt_tokens"] == len("<user>hello there<assistant>")
    s.close()
    events, state = s.ledger()
    n = names(events)
    assert n.count("RequestAdmitted") == n.count("RequestFinished") == 1
    freed = [e for e in events if type(e).__name__ == "BlocksFreed"]
    assert freed and freed[-1].reason == "finished" and not state.blocks.get(0)


@pytest.mark.parametrize("fails_on", ["Tokenize", "Generate"])
def test_a_request_whose_message_cannot_reach_its_worker_is_answered_and_holds_nothing(stack, fails_on):
    """Sending a request's message to its worker can raise (a message that cannot be encoded):
    the request is answered with the reason, finished by the book, and the next request runs."""
    s = stack()
    send = s.proc.workers.send_to_worker

    def failing(worker, msg):
        if type(msg).__name__ == fails_on and getattr(msg, "request_id", None) is not None:
            raise ValueError("cannot encode this message")
        return send(worker, msg)

    s.proc.call(lambda p: setattr(p.workers, "send_to_worker", failing)).result(5)
    r = s.chat("hello there", max_tokens=3)
    assert r.status_code == 500 and r.json()["error"]["code"] == "worker_send_failed", r.text
    s.proc.call(lambda p: setattr(p.workers, "send_to_worker", send)).result(5)
    assert s.chat("hello again", max_tokens=3).status_code == 200
    s.close()
    events, state = s.ledger()
    n = names(events)
    assert n.count("RequestAdmitted") == n.count("RequestFinished")
    assert not state.blocks.get(0)


def test_the_next_turn_reuses_the_sessions_pages(stack):
    s = stack()
    convo = [{"role": "user", "content": "a first question, long enough for pages"}]
    r1 = s.chat(convo, session="s1").json()
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "and a second one"}]
    r2 = s.chat(convo, session="s1").json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len("<user>a first question, long enough for pages<assistant>") // P) * P - P
    assert r2["usage"]["computed_tokens"] == r2["usage"]["prompt_tokens"] - cached
    assert s.session("s1")["tier"] == "device"



def test_a_session_counts_its_tokens_while_it_generates(stack):
    s = stack()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("count me", session="c", max_tokens=200)))
    t.start()
    seen = []
    deadline = time.monotonic() + 30
    while t.is_alive() and time.monotonic() < deadline:
        got = s.client.get("/admin/sessions/c")          # 404 until the turn is admitted
        if got.status_code == 200 and got.json()["busy"]:
            seen.append(got.json()["num_tokens"])
        time.sleep(0.005)
    t.join(30)
    u = out["r"].json()["usage"]
    assert seen and max(seen) > 0, seen                     # not 0 until the turn ends
    assert seen == sorted(seen) and max(seen) <= u["prompt_tokens"] + u["completion_tokens"] - 1
    assert s.session("c")["num_tokens"] == u["prompt_tokens"] + u["completion_tokens"] - 1


def test_a_restored_session_and_a_rebuilt_one_count_its_tokens_not_its_page_slots(stack):
    from residency.control.scheduler.config import SchedulerConfig
    from residency.control.scheduler.core import Scheduler
    s = stack()
    u = s.chat("an odd number of tokens", session="odd", max_tokens=6).json()["usage"]
    held = u["prompt_tokens"] + u["completion_tokens"] - 1
    assert held % P and s.session("odd")["num_tokens"] == held       # a partial last page
    assert s.client.post("/admin/sessions/odd/park").status_code == 200
    assert s.client.post("/admin/sessions/odd/restore").status_code == 200
    recorded, state = read_ledger(s.url)                # as a control restarting now would fold it
    restored = [r.event for r in recorded if type(r.event).__name__ == "SessionRestored"]
    assert [e.restored_tokens for e in restored] == [held]             # not pages * P
    assert state.sessions["odd"].restored_tokens == held
    rebuilt = Scheduler(SchedulerConfig(page_tokens=P, max_context=256))
    rebuilt.rebuild(state)
    assert rebuilt.sessions["odd"].num_tokens == held


def test_a_turn_on_a_busy_session_is_409(stack):
    s = stack(faults=BUSY)
    t, out = generating(s, "busy")
    r = s.chat("again", session="busy")
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
    t.join(30)
    assert out["r"].status_code == 200


class HeldTokenizer(ByteTokenizer):
    """Holds the encoding of a text with HOLD in it until ``release`` is set."""

    def __init__(self):
        self.holding, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        if "HOLD" in text:
            self.holding.set()
            assert self.release.wait(60), "never released"
        return super().encode(text, add_special)


def test_a_prompt_still_being_tokenized_holds_up_no_other_request(stack):
    """Tokenizing runs on the worker's side threads: while one prompt's encoding is held (a huge
    prompt takes ~0.5 s), another request is tokenized, admitted and generated to the end."""
    tok = HeldTokenizer()
    s = stack(tokenizer=tok)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("HOLD on", max_tokens=3)))
    t.start()
    try:
        assert tok.holding.wait(20)
        r = s.chat("meanwhile", max_tokens=12)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        assert t.is_alive() and "r" not in out, "the held request finished before it was released"
    finally:
        tok.release.set()
        t.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 3


def test_requests_beyond_what_the_worker_batches_wait_for_a_slot_and_all_finish(stack):
    s = stack(max_seqs=2)
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: s.chat(f"request {i}", max_tokens=10)}))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == list(range(6))
    for r in out.values():
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 10 and r.json()["choices"][0]["finish_reason"] == "length"
    s.close()
    events, _ = s.ledger()
    assert names(events).count("RequestFinished") == 6 and "RequestRefused" not in names(events)
    queued = {e.request_id for e in events if type(e).__name__ == "RequestQueued"}
    admitted = [e.request_id for e in events if type(e).__name__ == "RequestAdmitted"]
    assert queued and queued <= set(admitted) and len(admitted) == 6     # recorded once each, every one admitted


def test_a_request_that_can_never_fit_is_refused_with_the_numbers(stack):
    s = stack(device_blocks=8)
    r = s.chat("x" * 20, max_tokens=40)
    assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_kv_capacity"
    assert "limit is 8 pages" in r.json()["error"]["message"]
    s.close()
    events, _ = s.ledger()
    refused = [e for e in events if type(e).__name__ == "RequestRefused"]
    assert len(refused) == 1 and refused[0].reason.startswith("insufficient_kv_capacity")


def test_a_request_waits_while_an_idle_session_is_parked_to_make_room(stack):
    s = stack(device_blocks=24)
    r1 = s.chat("y" * 40, session="idle", max_tokens=8)     # ~17 pages resident afterwards
    assert r1.status_code == 200 and s.session("idle")["tier"] == "device"
    r2 = s.chat("z" * 30, max_tokens=20)                     # needs ~15 pages: only ~7 free
    assert r2.status_code == 200, r2.text
    assert s.session("idle")["tier"] == "host"
    s.close()
    events, _ = s.ledger()
    park = next(i for i, e in enumerate(events) if type(e).__name__ == "MoveRequested" and e.kind == "park")
    admitted = [i for i, e in enumerate(events) if type(e).__name__ == "RequestAdmitted"]
    assert events[park].session == "idle" and events[park].reason.startswith("serving")
    assert admitted[0] < park < admitted[1], "the second request was admitted only after the park"
    [queued] = [i for i, e in enumerate(events) if type(e).__name__ == "RequestQueued"]
    q = events[queued]
    assert admitted[0] < queued < park and q.parks == ["idle"] and q.needed_blocks > q.free_blocks
    assert q.request_id == events[admitted[1]].request_id and q.waiting_for.startswith("needs")


def test_a_parked_prefix_is_recomputed_when_the_policy_says_so(stack):
    s = stack(restore_policy="recompute")
    convo = [{"role": "user", "content": "a question that fills a few pages"}]
    r1 = s.chat(convo, session="s").json()
    assert s.client.post("/admin/sessions/s/park").json()["tier"] == "host"
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "more"}]
    u = s.chat(convo, session="s").json()["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 0 and u["restored_tokens"] == 0
    assert u["computed_tokens"] == u["prompt_tokens"]
    s.close()
    events, state = s.ledger()
    freed = [e for e in events if type(e).__name__ == "CopiesReleased" and e.tier == "host"]
    assert freed, "the parked copies of the recomputed prefix are released"
    assert not [e for e in events if type(e).__name__ == "MoveRequested" and e.kind == "restore"]


def test_a_parked_prefix_is_restored_when_the_policy_says_so(stack):
    s = stack(restore_policy="restore")
    convo = [{"role": "user", "content": "a question that fills a few pages"}]
    r1 = s.chat(convo, session="s").json()
    assert s.client.post("/admin/sessions/s/park", json={"tier": "disk"}).json()["tier"] == "disk"
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "more"}]
    u = s.chat(convo, session="s").json()["usage"]
    assert u["restored_tokens"] == u["prompt_tokens_details"]["cached_tokens"] > 0
    s.close()
    events, _ = s.ledger()
    restores = [e for e in events if type(e).__name__ == "MoveRequested" and e.kind == "restore"]
    assert [(m.src, m.dst, m.session) for m in restores] == [("disk", "device", "s")]
    assert names(events).count("SessionRestored") == 1


def test_the_idle_policy_parks_an_idle_session(stack):
    s = stack(park_idle_s=0.3)
    s.chat("a session that goes idle", session="quiet")
    deadline = time.monotonic() + 15
    while s.session("quiet")["tier"] != "host":
        assert time.monotonic() < deadline, "the idle session was never parked"
        time.sleep(0.05)


def test_an_idle_park_takes_the_pages_the_last_turn_restored_too(stack):
    s = stack(restore_policy="restore", policy=PolicyConfig(pressure=False, park=True, park_idle_s=0.3, cooldown_s=60))
    convo = [{"role": "user", "content": "a first question long enough for pages"}]
    r1 = s.chat(convo, session="twice").json()

    def parked_whole() -> dict:
        deadline = time.monotonic() + 15
        while (info := s.session("twice"))["blocks_by_tier"]["device"]:
            assert time.monotonic() < deadline, f"pages stayed on the device: {info}"
            time.sleep(0.05)
        return info
    parked_whole()
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "and then?"}]
    u = s.chat(convo, session="twice").json()["usage"]
    assert u["restored_tokens"] > 0                           # these pages are cooling for a minute
    assert u["prompt_tokens_details"]["cached_tokens"] + u["computed_tokens"] == u["prompt_tokens"]
    info = parked_whole()
    assert info["tier"] == "host" and info["blocks_by_tier"]["host"] == info["num_blocks"]


def test_device_pressure_spills_cold_pages_but_never_pages_a_running_turn_uses(stack):
    policy = PolicyConfig(pressure=True, high_watermark=0.3, low_watermark=0.2, hot_s=0.05, cooldown_s=0.0,
                          park=False)
    s = stack(device_blocks=64, policy=policy)
    s.chat("another conversation, idle and cold", session="other", max_tokens=4)
    convo = [{"role": "user", "content": "a conversation whose first pages go cold while it runs"}]
    r1 = s.chat(convo, session="s", max_tokens=4).json()
    time.sleep(0.3)                                   # its pages are cold now
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "go on"}]
    r2 = s.chat(convo, session="s", max_tokens=80)    # the device passes the high watermark meanwhile
    assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 80
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    s.close()
    events, _ = s.ledger()
    evicts = [e for e in events if type(e).__name__ == "MoveRequested" and e.kind == "evict" and e.src != e.dst]
    assert evicts and {e.session for e in evicts} <= {"other", None}, "the cold idle pages are what spills"
    rejected = [e for e in events if type(e).__name__ == "MoveRejected"]
    assert not rejected, f"a policy tried to move pages a running turn uses: {rejected[:2]}"


def test_parked_pages_go_to_disk_under_host_pressure_and_come_back_from_both_tiers(stack):
    policy = PolicyConfig(pressure=True, park=True, park_idle_s=0.2, high_watermark=0.5, low_watermark=0.3,
                          hot_s=0.05, cooldown_s=0.0)
    s = stack(policy=policy, host_blocks=20, restore_policy="restore")
    convo = [{"role": "user", "content": "a conversation long enough to fill a dozen pages of KV"}]
    r1 = s.chat(convo, session="s", max_tokens=4).json()
    deadline = time.monotonic() + 20
    while s.session("s")["tier"] != "disk":            # parked to host, then partly demoted to disk
        assert time.monotonic() < deadline, s.session("s")
        time.sleep(0.05)
    convo += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "next"}]
    u = s.chat(convo, session="s", max_tokens=4).json()["usage"]
    assert u["restored_tokens"] == u["prompt_tokens_details"]["cached_tokens"] > 0
    s.close()
    events, _ = s.ledger()
    kinds = {(e.kind, e.src, e.dst) for e in events if type(e).__name__ == "MoveRequested" and e.src != e.dst}
    assert {("park", "device", "host"), ("demote", "host", "disk"), ("restore", "disk", "device")} <= kinds
