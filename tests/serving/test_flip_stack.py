"""Sleep, wake and flips through the HTTP API on the serving stack (tiny model, real control, real
worker over ZMQ, real ledger). The worker's side of ``SwapWeights`` is flipw's (issue #28); until it
is served, a stand-in at the worker's edge answers the command as its contract says, moving no
byte, so what the control does around it is what is tested here: the drain and the parks first,
the write-ahead records, the verdict, requests held while asleep or stranded, the refusals."""
from __future__ import annotations

import threading
import time

import msgspec

from residency.control.replay import replay
from residency.control.state import state_hash
from residency.events import catalog as ev
from residency.events.commands import ServedModel, SwapWeights, WeightsSwapped
from tests.serving.stack import names, stack  # noqa: F401  (fixture)

SECOND = 1_000_000_000
TINY_WEIGHTS_BYTES = 2 * (4 * 64 * 64 + 3 * 64 * 128) * 4 + 300 * 64 * 4     # tests/serving/stack.py's TINY, fp32


class StandIn:
    """The worker's answer to SwapWeights per its contract (events/commands.py), no bytes moved:
    ``silent`` answers nothing (a worker that hangs)."""

    def __init__(self, resident: str, nbytes: dict[str, int]):
        self.resident, self.slept, self.gen, self.nbytes = resident, "", 0, nbytes
        self.silent = False
        self.calls: list[SwapWeights] = []

    def __call__(self, cmd: SwapWeights) -> list:
        self.calls.append(cmd)
        if self.silent:
            return []
        was, out, inn, err = self.resident, 0, 0, ""
        if cmd.action == "sleep":
            out = self.nbytes[was] if cmd.level == 1 else 0
            self.slept, self.resident = was, ""
        elif cmd.action == "wake":
            inn, self.resident = self.nbytes[self.slept or was], self.slept or was
        elif cmd.to_model not in self.nbytes:
            err = f"unknown model {cmd.to_model!r}"
        else:
            out, inn, self.resident = self.nbytes[was], self.nbytes[cmd.to_model], cmd.to_model
        if not err:
            self.gen = cmd.to_gen
        t0 = time.time_ns()
        return [WeightsSwapped(flip_id=cmd.flip_id, worker=0, action=cmd.action, from_model=was,
                               resident=self.resident if not err else was, from_gen=self.gen, to_gen=cmd.to_gen,
                               bytes_out=out, bytes_in=inn, checksum_ok=not err, steps=1,
                               stamps={} if err else {"runner": cmd.to_gen, "serving": cmd.to_gen},
                               started_ns=t0, finished_ns=t0 + 1000, error=err)]


def weights_bytes(s) -> int:
    return s.proc.call(lambda p: p.state.arenas["0:weights"].bytes).result(5)


def stand_in(s, models: dict[str, int] | None = None) -> StandIn:
    """Also puts the worker's weights on the books, as ``residency serve``'s workers do in Hello
    (the stack's worker keeps no memory books): the control records WeightsLoaded from it."""
    if not s.proc.call(lambda p: "0:weights" in p.state.arenas).result(5):
        s.proc.call(lambda p: p.record(ev.WeightsLoaded(worker=0, arena="weights", model="tiny",
                                                        bytes=TINY_WEIGHTS_BYTES))).result(5)
    nbytes = models or {"tiny": weights_bytes(s)}
    w = StandIn("tiny", nbytes)
    s.worker.core.register(SwapWeights, w)
    return w


def two_models(s, other_bytes: int) -> None:
    """The worker as it says ServingReady with two models (flipw's worker will; this one serves one)."""
    def inject(p):
        ready = s.service.workers.ready[0]
        models = [ServedModel(name="tiny", digest=ready.model_digest, max_context=ready.max_context,
                              eos_token_ids=[], weights_bytes=p.state.arenas["0:weights"].bytes,
                              block_bytes=p.state.workers[0].block_bytes),
                  ServedModel(name="other", digest="d2", max_context=ready.max_context, eos_token_ids=[],
                              weights_bytes=other_bytes, block_bytes=p.state.workers[0].block_bytes, host_image=True)]
        s.service.on_ready(p.workers.by_worker[0], msgspec.structs.replace(ready, models=models, resident="tiny"))
    s.proc.call(inject).result(5)


def live_equals_replay(s) -> None:
    live = s.proc.call(lambda p: (p.state.last_seq, state_hash(p.state))).result(5)
    state, _ = replay(s.store, to_seq=live[0], use_snapshots=False)
    assert state_hash(state) == live[1]


def chat_model(s, model: str, text: str, max_tokens: int = 6):
    return s.client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": max_tokens, "temperature": 0})


def test_sleep_parks_first_holds_requests_and_wake_lets_them_flow_with_the_same_output(stack):
    s = stack(device_blocks=64)
    worker = stand_in(s)
    before = s.chat("the same words every time", max_tokens=10).json()["choices"][0]["message"]["content"]
    assert s.chat("a session's turn", session="s1", max_tokens=6).status_code == 200
    assert s.client.get("/is_sleeping").json() == {"is_sleeping": False}

    r = s.client.post("/sleep?level=1")
    assert r.status_code == 200 and r.json()["outcome"] == "completed", r.text
    kinds = [e["type"] for e in r.json()["events"]]
    # the session's pages were parked before anything was written for the flip
    assert "SessionParked" in kinds and kinds.index("SessionParked") < kinds.index("FlipRequested")
    assert kinds[kinds.index("FlipRequested"):] == ["FlipRequested", "RebindRequested", "ReaderStamped",
                                                    "FlipCompleted", "ReaderStamped", "RebindCommitted"]
    req = next(e for e in r.json()["events"] if e["type"] == "FlipRequested")
    assert (req["action"], req["level"], req["from_model"], req["bytes_out"]) == ("sleep", 1, "tiny", weights_bytes(s))
    [cmd] = worker.calls
    assert (cmd.flip_id, cmd.action, cmd.level, cmd.to_gen) == (req["flip_id"], "sleep", 1, req["to_gen"])
    assert s.session("s1")["tier"] == "host"
    assert s.client.get("/is_sleeping").json() == {"is_sleeping": True}
    [card] = s.client.get("/v1/models").json()["data"]
    assert (card["id"], card["residency"]) == ("tiny", "asleep")

    # sleep while asleep: 409 naming why, and the ledger gains the refusal only
    n = len(s.ledger()[0])
    again = s.client.post("/sleep?level=2")
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_asleep", again.text
    added = s.ledger()[0][n:]
    assert names(added) == ["MoveRefused"] and added[0].reason.startswith("already_asleep")
    assert s.client.post("/sleep?level=3").status_code == 400

    s.service.flips.waiting.wait_ns = SECOND // 2           # a request arriving asleep waits, then 503 naming the state
    held = s.chat("asleep?", max_tokens=4)
    assert held.status_code == 503 and held.json()["error"]["code"] == "asleep", held.text

    s.service.flips.waiting.wait_ns = 30 * SECOND
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("the same words every time", max_tokens=10)))
    t.start()
    deadline = time.monotonic() + 10
    while not s.proc.call(lambda p: len(s.service.flips.waiting.held)).result(5):
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.02)
    w = s.client.post("/wake_up")
    assert w.status_code == 200 and w.json()["outcome"] == "completed", w.text
    t.join(20)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["message"]["content"] == before
    assert s.client.get("/is_sleeping").json() == {"is_sleeping": False}
    awake = s.client.post("/wake_up")
    assert awake.status_code == 409 and awake.json()["error"]["code"] == "not_asleep"
    assert s.chat("and the next turn", session="s1", max_tokens=6).status_code == 200
    events, state = s.ledger()
    arena = state.arenas["0:weights"]
    assert not arena.asleep and arena.num_flips == 2 and arena.gen == worker.gen
    live_equals_replay(s)


def test_a_flip_the_worker_never_answers_is_stranded_and_a_complete_wake_repairs_it(stack):
    s = stack(device_blocks=32)
    worker = stand_in(s)
    worker.silent = True
    s.service.flips.deadline_s = 0.3
    r = s.client.post("/sleep")
    assert r.status_code == 503 and r.json()["outcome"] == "stranded", r.text
    failed = next(e for e in r.json()["events"] if e["type"] == "FlipFailed")
    assert failed["stranded"] and failed["stranded_bytes"] == weights_bytes(s) > 0 and "deadline" in failed["error"]
    assert r.json()["events"][-1]["type"] == "RebindTorn"
    health = s.client.get("/health")
    assert health.status_code == 503 and failed["flip_id"] in str(health.json())
    s.service.flips.waiting.wait_ns = SECOND // 2
    refused = s.chat("nothing serves a stranded arena", max_tokens=4)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "weights_stranded", refused.text

    worker.silent, worker.slept = False, "tiny"
    w = s.client.post("/wake_up")                   # a complete wake repairs it
    assert w.status_code == 200 and w.json()["outcome"] == "completed", w.text
    assert s.client.get("/health").status_code == 200
    assert s.chat("served again", max_tokens=4).status_code == 200
    live_equals_replay(s)


def test_flips_between_two_models_on_demand_and_by_policy(stack):
    s = stack(device_blocks=32)
    other = TINY_WEIGHTS_BYTES * 2 + 4096
    worker = stand_in(s, {"tiny": TINY_WEIGHTS_BYTES, "other": other})
    two_models(s, other)
    cards = {c["id"]: c for c in s.client.get("/v1/models").json()["data"]}
    assert (cards["tiny"]["residency"], cards["other"]["residency"]) == ("resident", "host")

    bad = s.client.post("/admin/flip", json={"to": "nope"})
    assert bad.status_code == 404 and "'other'" in bad.json()["error"]["message"], bad.text
    assert s.client.post("/admin/flip", json={"to": "other", "bogus": 1}).status_code == 400
    same = s.client.post("/admin/flip", json={"to": "tiny"})
    assert same.status_code == 409 and same.json()["error"]["code"] == "already_resident"

    r = s.client.post("/admin/flip", json={"to": "other", "worker": 0})
    assert r.status_code == 200 and r.json()["outcome"] == "completed", r.text
    req = next(e for e in r.json()["events"] if e["type"] == "FlipRequested")
    assert (req["from_model"], req["to_model"], req["bytes_in"]) == ("tiny", "other", other)
    cards = {c["id"]: c for c in s.client.get("/v1/models").json()["data"]}
    assert cards["other"]["residency"] == "resident" and cards["other"]["arena_gen"] == req["to_gen"]
    assert chat_model(s, "other", "now the other model").status_code == 200

    # a request for the model flipped out waits, and the policy flips back (nothing else in hand)
    back = chat_model(s, "tiny", "and back again")
    assert back.status_code == 200, back.text
    assert [c.to_model for c in worker.calls] == ["other", "tiny"]
    events, state = s.ledger()
    flips = [e for e in events if type(e) is ev.FlipRequested]
    assert [(f.from_model, f.to_model) for f in flips] == [("tiny", "other"), ("other", "tiny")]
    assert state.arenas["0:weights"].model == "tiny"
    queued = [e for e in events if type(e) is ev.RequestQueued]
    assert any("model_not_resident" in q.waiting_for for q in queued)
    live_equals_replay(s)


def test_a_sleep_whose_requests_do_not_end_in_time_is_refused_naming_them(stack):
    s = stack(device_blocks=128)
    worker = stand_in(s)
    s.service.flips.drain_ns = 0                    # any request still running when the sleep is asked
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("a long one", session="busy", max_tokens=100)))
    t.start()
    deadline = time.monotonic() + 10
    while not s.session("busy").get("busy"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = s.client.post("/sleep")
    t.join(30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running", r.text
    assert names_of(r) == ["MoveRefused"] and "1 request(s) still run" in r.json()["error"]["message"]
    assert worker.calls == [] and out["r"].status_code == 200           # nothing was sent; the turn finished
    assert s.client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert s.client.post("/sleep").status_code == 200                   # idle now: it sleeps


def names_of(r) -> list[str]:
    return [e["type"] for e in r.json()["events"]]


def test_a_policy_flip_the_worker_refuses_is_recorded_once_not_retried_every_tick(stack):
    s = stack(device_blocks=32)
    other = TINY_WEIGHTS_BYTES + 4096
    worker = stand_in(s, {"tiny": TINY_WEIGHTS_BYTES})      # it does not know "other": it refuses the flip
    two_models(s, other)
    s.service.flips.waiting.wait_ns = 2 * SECOND
    r = chat_model(s, "other", "a model the worker will not take")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_resident", r.text
    events, state = s.ledger()
    failed = [e for e in events if type(e) is ev.FlipFailed]
    assert len(worker.calls) == 1 and len(failed) == 1 and "unknown model" in failed[0].error
    assert not failed[0].stranded and state.arenas["0:weights"].model == "tiny"
    assert s.chat("the resident model still serves", max_tokens=4).status_code == 200


def test_a_sleep_the_dial_refuses_to_shrink_completes_and_one_the_worker_refuses_grows_its_pool_back(stack):
    """The device KV pool a sleep gives back goes through the dial: under a budget floor the dial
    refuses the one-block pool (its arithmetic in ``kv_pool``) and the sleep completes anyway;
    when the worker refuses the sleep itself, the pool already shrunk is grown back at once."""
    from residency.events.asks import AskSetBudget

    s = stack(device_blocks=16)
    worker = stand_in(s)
    bb = s.proc.call(lambda p: p.state.workers[0].block_bytes).result(5)

    def pool_bytes() -> int:
        return s.proc.call(lambda p: p.state.workers[0].tiers["device"].capacity_bytes).result(5)

    before = s.chat("the same words every time", max_tokens=8).json()["choices"][0]["message"]["content"]
    assert s.proc.submit(AskSetBudget(ask_id="b1", worker=0, tier="device", floor_bytes=3 * bb,
                                      ceiling_bytes=0)).result(5).error is None
    r = s.client.post("/sleep?level=1")
    assert r.status_code == 200 and r.json()["outcome"] == "completed", r.text
    [kv] = r.json()["kv_pool"]
    assert (kv["resized"], kv["floor_bytes"], kv["asked_bytes"]) == (False, 3 * bb, bb), kv
    assert f"< floor {3 * bb}" in kv["reason"] and pool_bytes() == 16 * bb
    w = s.client.post("/wake_up")
    assert w.status_code == 200 and w.json()["kv_pool"] == [], w.text
    assert s.chat("the same words every time", max_tokens=8).json()["choices"][0]["message"]["content"] == before

    assert s.proc.submit(AskSetBudget(ask_id="b2", worker=0, tier="device", floor_bytes=0,
                                      ceiling_bytes=0)).result(5).error is None

    def refuse(cmd: SwapWeights) -> list:
        t0 = time.time_ns()
        return [WeightsSwapped(flip_id=cmd.flip_id, worker=0, action=cmd.action, from_model="tiny", resident="tiny",
                               from_gen=worker.gen, to_gen=cmd.to_gen, bytes_out=0, bytes_in=0, checksum_ok=False,
                               steps=0, stamps={}, started_ns=t0, finished_ns=t0, error="no pinned room for the image")]
    s.worker.core.register(SwapWeights, refuse)
    r = s.client.post("/sleep?level=1")
    assert r.status_code == 409 and r.json()["error"]["code"] == "flip_failed", r.text
    assert [(k["resized"], k["from_bytes"], k["to_bytes"]) for k in r.json()["kv_pool"]] == [
        (True, 16 * bb, bb), (True, bb, 16 * bb)], r.text
    assert pool_bytes() == 16 * bb and s.client.get("/is_sleeping").json() == {"is_sleeping": False}
    assert s.chat("the same words every time", max_tokens=8).json()["choices"][0]["message"]["content"] == before
    events, state = s.ledger()
    assert [(e.from_bytes, e.to_bytes) for e in events if type(e) is ev.PoolResized] == [(16 * bb, bb), (bb, 16 * bb)]
    live_equals_replay(s)
