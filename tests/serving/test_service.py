"""The serving stack without SmolLM2: a tiny random Llama behind the real pieces.

    TestClient ─► create_app ─► ServingService ─► ControlProc (ledger) ─ZMQ─► WorkerProc (thread)
                                                                          WorkerCore + Mover + ServingLoop

Everything but the model and the tokenizer is what ``residency serve`` runs, so admission waits,
parks of idle sessions, refusals, busy sessions and restore-or-recompute are exercised in seconds.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from residency.control.api import ApiConfig, create_app
from residency.control.moves import MoveConfig
from residency.control.policy import PolicyConfig
from residency.control.proc import ControlConfig, ControlProc
from residency.control.scheduler.service import ServingService
from residency.dataplane.mover import Mover
from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.pools import DataPlaneError, KVLayout
from residency.dataplane.proc import WorkerProc
from residency.dataplane.serving import ServingLoop
from residency.dataplane.serving_worker import attach
from residency.dataplane.worker import WorkerCore, WorkerFaults
from residency.ledger import LedgerStore
from tests.serving.server import read_ledger

P = 4
TINY = ModelConfig(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128,
                   vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, max_position=256,
                   tie_embeddings=True)


class ByteTokenizer:
    """Bytes as tokens (1..256), a visible chat template, and no end-of-turn: the random model
    always generates max_tokens."""

    eos_token_ids: set[int] = set()
    max_token_bytes = 1

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [b + 1 for b in text.encode()]

    def surely_over(self, text: str, max_tokens: int) -> bool:
        return len(text.encode()) > max_tokens

    def decode(self, ids, skip_special: bool = False) -> str:
        return bytes(i - 1 for i in ids if 0 < i <= 256).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


class Stack:
    def __init__(self, device_blocks: int = 64, restore_policy: str = "cost", park_idle_s: float | None = None,
                 policy: PolicyConfig | None = None, host_blocks: int = 256, tokenizer=None,
                 max_seqs: int = 64, share_prefixes: bool = True, retain_fraction: float = 0.0, workers: int = 1):
        self.dir = Path(tempfile.mkdtemp(prefix="rsv-", dir="/tmp"))
        self.url = f"sqlite:///{self.dir / 'ledger.db'}"
        self.store = LedgerStore.open(self.url, create=True)
        policy = policy or PolicyConfig(pressure=False, park=park_idle_s is not None,
                                        park_idle_s=park_idle_s or 30.0, cooldown_s=0.0)
        cfg = ControlConfig(worker_endpoint=f"ipc://{self.dir}/w.sock", expected_workers=list(range(workers)),
                            policy=policy, moves=MoveConfig(page_tokens=P), shutdown_grace_s=1.0)
        self.proc = ControlProc(self.store, cfg)
        self.service = ServingService(self.proc, restore_policy=restore_policy, wait_timeout_s=10.0,
                                      share_prefixes=share_prefixes, retain_fraction=retain_fraction)
        self.app = create_app(self.service, ApiConfig(admin_key=None))
        self.proc.start()
        model = random_model(TINY, seed=0)
        kv = KVLayout(TINY.num_layers, P, TINY.num_kv_heads, TINY.head_dim, dtype=torch.float32)
        host = host_blocks * kv.block_bytes
        self.workers, self.threads = [], []
        for w in range(workers):             # one model, one worker thread each (as one process per GPU)
            mover = Mover(kv, device_blocks, host, self.dir / f"disk{w}",
                           Mover.pinned_bytes_needed(kv, device_blocks, host), "cpu", worker=w, fsync=False)
            core = WorkerCore(mover, w, WorkerFaults(), expected_errors=(DataPlaneError,))
            loop = ServingLoop(worker=w, runner=model.runner, tokenizer=tokenizer or ByteTokenizer(),
                               device_pool=mover.device_pool, model_id="tiny", model_digest=model.kv_digest,
                               page_tokens=P, keys_fn=block_content_keys, max_seqs=max_seqs)
            attach(core, loop, kv.block_bytes)
            self.workers.append(WorkerProc(worker=w, epoch=1, endpoint=cfg.worker_endpoint, core=core, device="cpu",
                                           block_bytes=kv.block_bytes, faults=WorkerFaults()))
            self.threads.append(threading.Thread(target=self.workers[-1].run, daemon=True))
            self.threads[-1].start()
        self.worker, self.thread = self.workers[0], self.threads[0]
        self.client = TestClient(self.app)
        deadline = time.monotonic() + 20
        while len(self.service.workers.ready) < workers:
            assert time.monotonic() < deadline, "a worker never said ServingReady"
            time.sleep(0.02)

    def chat(self, text: str | list, session: str | None = None, max_tokens: int = 6, **kw):
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
        if session:
            body["session_id"] = session
        return self.client.post("/v1/chat/completions", json=body)

    def session(self, name: str) -> dict:
        return self.client.get(f"/admin/sessions/{name}").json()

    def close(self):
        self.client.close()
        self.service.close()
        self.proc.stop("test done")
        for w, t in zip(self.workers, self.threads):
            w.stop("test done")
            t.join(10)
        self.store.close()

    def ledger(self):
        events, state = read_ledger(self.url)
        state.check_integrity()
        return [r.event for r in events], state


@pytest.fixture
def stack():
    made = []

    def make(**kw) -> Stack:
        made.append(Stack(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
        shutil.rmtree(s.dir, ignore_errors=True)


def names(events) -> list[str]:
    return [type(e).__name__ for e in events]


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


def generating(s: Stack, session: str) -> tuple[threading.Thread, dict]:
    """A long turn of ``session`` running in a thread, once the session says it is busy."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("a long one", session=session, max_tokens=60)))
    t.start()
    deadline = time.monotonic() + 10
    while not s.session(session).get("busy"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return t, out


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
    s = stack()
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
    assert seen[-3:] == ["MoveRequested", "CopiesReleased", "SessionDeleted"]


def test_a_session_generating_cannot_be_deleted(stack):
    s = stack()
    t, out = generating(s, "live")
    r = s.client.delete("/admin/sessions/live")
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
    t.join(30)
    assert out["r"].status_code == 200 and s.client.delete("/admin/sessions/live").status_code == 200


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
