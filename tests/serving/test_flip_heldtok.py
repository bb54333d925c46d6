"""A request held for a model that is not resident is tokenized while it waits (issue #28), on the
serving stack (real control, real worker over ZMQ, real ledger; the worker's SwapWeights a
stand-in, as in test_flip_stack.py). Refused by the checks of any Tokenized before a flip is even
asked for; one that passes waits, keeps its tokens and runs after the flip without a second
Tokenize; one whose client leaves while its Tokenize is out leaves nothing held; a worker that
cannot tokenize for the model yet leaves the request to be tokenized after the flip, as before."""
from __future__ import annotations

import asyncio
import threading
import time

import msgspec

from residency.control.scheduler.port import GenerateRequest
from residency.events import catalog as ev
from residency.events.commands import ChatTurn, SamplingParams, ServedModel, SwapWeights, Tokenize, Tokenized
from tests.serving.stack import stack  # noqa: F401  (fixture)
from tests.serving.test_flip_stack import TINY_WEIGHTS_BYTES, chat_model, live_equals_replay, stand_in

OTHER_BYTES = TINY_WEIGHTS_BYTES * 2 + 4096


def two_models(s, other_context: int) -> None:
    """The worker as it says ServingReady with a second model, "other", of ``other_context`` tokens
    (the stack's worker tokenizes every model with its one tokenizer; the context is the card's)."""
    def inject(p):
        ready = s.service.workers.ready[0]
        bb = p.state.workers[0].block_bytes
        models = [ServedModel(name="tiny", digest=ready.model_digest, max_context=ready.max_context, eos_token_ids=[],
                              weights_bytes=p.state.arenas["0:weights"].bytes, block_bytes=bb),
                  ServedModel(name="other", digest="d2", max_context=other_context, eos_token_ids=[],
                              weights_bytes=OTHER_BYTES, block_bytes=bb, host_image=True)]
        s.service.on_ready(p.workers.by_worker[0], msgspec.structs.replace(ready, models=models, resident="tiny"))
    s.proc.call(inject).result(5)


class Tokenizes:
    """The worker's Tokenize, counted (and held back while ``gate`` is clear, for one model)."""

    def __init__(self, s, older_than=None):
        self.inner = s.worker.core.side_handlers[Tokenize]
        self.calls: list[Tokenize] = []
        self.gate = threading.Event()
        self.gate.set()
        self.older_than = older_than        # a StandIn: answer as an older worker would (resident model only)
        s.worker.core.register_side(Tokenize, self)

    def __call__(self, msg: Tokenize) -> list:
        self.calls.append(msg)
        self.gate.wait(30)
        w = self.older_than
        if w is not None and msg.model and msg.model != w.resident:
            return [Tokenized(request_id=msg.request_id, worker=0, token_ids=[], keys=[],
                              error=f"model_not_resident: {msg.model} is not on the device ({w.resident} is)")]
        return self.inner(msg)


def held_state(s) -> tuple[int, int, int]:
    """(requests held, Tokenize answers they wait for, requests in hand)."""
    f = s.service.flips.waiting
    return s.proc.call(lambda p: (len(f.held), len(f.tokenizing), len(s.service.requests.by_id))).result(5)


def until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_prompt_too_long_for_the_held_model_is_refused_before_any_flip(stack):
    s = stack(device_blocks=32)
    worker = stand_in(s, {"tiny": TINY_WEIGHTS_BYTES, "other": OTHER_BYTES})
    two_models(s, other_context=32)         # "other" holds 32 tokens; the resident "tiny" 256
    tok = Tokenizes(s)
    text = "forty bytes of a prompt, too long here.."
    assert s.chat(text, max_tokens=4).status_code == 200            # fits the resident model

    r = chat_model(s, "other", text, max_tokens=4)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages"), err
    assert "context window is 32 tokens" in err["message"]
    bias = s.client.post("/v1/chat/completions", json={"model": "other", "max_tokens": 2, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "hi"}],
                                                       "logit_bias": {"305": 3}})
    assert bias.status_code == 400 and bias.json()["error"]["code"] == "invalid_token_id", bias.text
    assert [m.model for m in tok.calls] == ["tiny", "other", "other"]   # for "other" while held
    assert worker.calls == [] and held_state(s) == (0, 0, 0)
    events, state = s.ledger()
    assert not [e for e in events if type(e) in (ev.FlipRequested, ev.MoveRefused)]
    queued = [e for e in events if type(e) is ev.RequestQueued]
    refused = {e.request_id: e.reason for e in events if type(e) is ev.RequestRefused}
    assert len(queued) == 2 and all("model_not_resident" in q.waiting_for for q in queued)
    assert [refused[q.request_id].split(":")[0] for q in queued] == ["context_length_exceeded", "invalid_token_id"]
    assert state.arenas["0:weights"].model == "tiny"
    live_equals_replay(s)


def tiny_answered_then_flipped_to_other(stack):
    """A stack serving "tiny" and "other": tiny's greedy answer taken, then the arena flipped to
    other, so a request for tiny is held. -> (stack, the stand-in worker, tiny's answer)."""
    s = stack(device_blocks=32)
    worker = stand_in(s, {"tiny": TINY_WEIGHTS_BYTES, "other": OTHER_BYTES})
    two_models(s, other_context=256)
    before = chat_model(s, "tiny", "the same words every time", max_tokens=8).json()["choices"][0]["message"]
    assert s.client.post("/admin/flip", json={"to": "other"}).json()["outcome"] == "completed"
    return s, worker, before


def test_a_held_request_that_passes_runs_after_the_flip_with_its_early_tokens(stack):
    s, worker, before = tiny_answered_then_flipped_to_other(stack)
    order: list[str] = []
    tok = Tokenizes(s)
    swap = s.worker.core.handlers[SwapWeights]
    s.worker.core.register(SwapWeights, lambda cmd: (order.append(f"swap:{cmd.to_model}"), swap(cmd))[1])
    inner = tok.inner
    tok.inner = lambda msg: (order.append(f"tokenize:{msg.model}"), inner(msg))[1]

    r = chat_model(s, "tiny", "the same words every time", max_tokens=8)     # held: "other" is resident
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == before
    assert order == ["tokenize:tiny", "swap:tiny"]          # tokenized once, before the flip back
    assert [c.to_model for c in worker.calls] == ["other", "tiny"] and held_state(s) == (0, 0, 0)
    events, _ = s.ledger()
    rid = next(e.request_id for e in events if type(e) is ev.RequestQueued)
    seq = {type(e).__name__: i for i, e in enumerate(events) if getattr(e, "request_id", None) == rid
           or type(e) is ev.FlipRequested}
    assert seq["RequestQueued"] < seq["FlipRequested"] < seq["RequestAdmitted"] < seq["RequestFinished"]
    live_equals_replay(s)


def test_a_held_request_whose_client_leaves_while_it_is_tokenized_leaves_nothing_held(stack):
    s = stack(device_blocks=32)
    worker = stand_in(s, {"tiny": TINY_WEIGHTS_BYTES, "other": OTHER_BYTES})
    two_models(s, other_context=256)
    tok = Tokenizes(s)
    tok.gate.clear()                        # the worker's answer is late: the Tokenize stays out

    async def leave() -> None:
        req = GenerateRequest(request_id="left-1", kind="chat", model="other", max_tokens_given=True,
                              sampling=SamplingParams(max_tokens=4, temperature=0.0),
                              messages=[ChatTurn(role="user", content="gone before it ran")])
        task = asyncio.ensure_future(s.service.submit(req))
        deadline = time.monotonic() + 10
        while held_state(s)[:2] != (1, 1):
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
        task.cancel()                       # the client goes away, as the API's handler is cancelled
        try:
            await task
        except asyncio.CancelledError:
            pass
    asyncio.run(leave())
    until(lambda: held_state(s) == (0, 0, 0), "the request of a client that left is still held")
    tok.gate.set()                          # the late answer finds nothing to act on
    until(lambda: len(tok.calls) == 1, "the held request was never tokenized")
    assert chat_model(s, "tiny", "still served", max_tokens=4).status_code == 200
    assert held_state(s) == (0, 0, 0) and worker.calls == []
    events, _ = s.ledger()
    mine = [e for e in events if getattr(e, "request_id", None) == "left-1"]
    assert [type(e).__name__ for e in mine] == ["RequestQueued", "RequestFinished"], mine
    assert mine[1].reason == "disconnected" and mine[1].completion_tokens == 0
    assert not [e for e in events if type(e) is ev.FlipRequested]
    live_equals_replay(s)


def test_a_worker_that_cannot_tokenize_the_held_model_yet_leaves_it_to_after_the_flip(stack):
    s, worker, before = tiny_answered_then_flipped_to_other(stack)
    tok = Tokenizes(s, older_than=worker)   # answers model_not_resident for a model not on the device

    r = chat_model(s, "tiny", "the same words every time", max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == before
    assert [m.model for m in tok.calls] == ["tiny", "tiny"]        # refused while held, then after the flip
    assert [c.to_model for c in worker.calls] == ["other", "tiny"] and held_state(s) == (0, 0, 0)
    live_equals_replay(s)
