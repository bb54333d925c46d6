"""HeldRequests' early Tokenize on its own (a recording stand-in for the control process at the
edge, the real RequestTable and RequestState): which answer it acts on, when a held request counts
for the flip policy, and when it is let go without its answer."""
from __future__ import annotations

import asyncio
import random

import pytest

from residency.control.flip_waiting import HeldRequests
from residency.control.scheduler.admission import TokensRefused, check_tokens
from residency.control.scheduler.bridge import RequestState
from residency.control.scheduler.port import GenerateRequest
from residency.control.scheduler.requests import RequestTable
from residency.events.commands import ChatTurn, SamplingParams, ServedModel, ServingReady, Tokenize, Tokenized


class Proc:
    def __init__(self):
        self.recorded, self.sent = [], []

    def record(self, event, correlation=None):
        self.recorded.append(event)
        return len(self.recorded)

    def send_to_worker(self, worker, msg):
        self.sent.append((worker, msg))
        return True


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def request(loop, rid: str, model: str = "b", **kw) -> RequestState:
    return RequestState(GenerateRequest(request_id=rid, kind="chat", model=model, max_tokens_given=True,
                                        sampling=SamplingParams(max_tokens=4, **kw),
                                        messages=[ChatTurn(role="user", content="hi")]), loop)


def held(proc=None):
    h = HeldRequests(proc or Proc(), RequestTable(), wait_s=60)
    h.out = {"begun": [], "refused": [], "left": [], "settled": 0}
    h.begin = h.out["begun"].append
    h.refuse = lambda r, status, code, message, param=None, retry_after_s=None: h.out["refused"].append((status, code))
    h.left = h.out["left"].append
    h.settled = lambda: h.out.__setitem__("settled", h.out["settled"] + 1)
    h.check = lambda r, msg, worker: check_tokens(r.req, msg, READY, None)
    return h


READY = ServingReady(worker=0, model="a", model_digest="d", max_context=64, page_tokens=4, block_bytes=1,
                     device_blocks=8, eos_token_ids=[], max_seqs=4, models=[ServedModel(name="a", digest="d", max_context=64, eos_token_ids=[],
                                                     weights_bytes=1, block_bytes=1),
                                         ServedModel(name="b", digest="e", max_context=16, eos_token_ids=[],
                                                     weights_bytes=1, block_bytes=1)])


def answer(rid: str, n: int, worker: int = 0, error: str | None = None) -> Tokenized:
    ids = [random.randrange(1, 300) for _ in range(n)]
    return Tokenized(request_id=rid, worker=worker, token_ids=[] if error else ids, keys=[], error=error, vocab_size=300)


def test_the_held_request_is_tokenized_for_its_model_and_counts_only_once_it_passed(loop):
    h = held()
    r = request(loop, "r1")
    h.hold(r, "model_not_resident", "b is not resident", worker=0, tokenizers=[1, 0])
    [(worker, msg)] = h.proc.sent
    assert worker == 1 and type(msg) is Tokenize and msg.model == "b" and msg.messages == r.req.messages
    assert h.backlog() == {}                                    # its answer may refuse it
    h.on_tokenized(r, 0, answer("r1", 5))                       # not the worker asked: not ours
    assert r.tokenized is None and h.out["settled"] == 0
    good = answer("r1", 5, worker=1)
    h.on_tokenized(r, 1, good)
    assert r.tokenized is good and h.out["settled"] == 1 and list(h.backlog()) == ["b"]
    h.release(lambda model: [0])
    assert h.out["begun"] == [r] and r.phase == "new" and h.held == [] and h.tokenizing == {}


def test_a_held_request_its_model_refuses_is_answered_at_once(loop):
    h = held()
    long, biased = request(loop, "long"), request(loop, "biased", logit_bias={305: 1.0})
    for r in (long, biased):
        h.hold(r, "model_not_resident", "b is not resident", worker=0, tokenizers=[0])
    h.on_tokenized(long, 0, answer("long", 16))                 # b holds 16 tokens: a prompt of 16 does not fit
    h.on_tokenized(biased, 0, answer("biased", 3))
    assert h.out["refused"] == [(400, "context_length_exceeded"), (400, "invalid_token_id")]
    assert h.held == [] and h.tokenizing == {} and h.backlog() == {}
    assert isinstance(check_tokens(long.req, answer("long", 16), READY, None), TokensRefused)


def test_a_worker_that_cannot_tokenize_for_the_model_leaves_it_held_and_counted(loop):
    h = held()
    r = request(loop, "r1")
    h.hold(r, "model_not_resident", "b is not resident", worker=0, tokenizers=[0])
    h.on_tokenized(r, 0, answer("r1", 0, error="model_not_resident: b is not on the device (a is)"))
    assert h.out["refused"] == [] and r.tokenized is None and h.held == [r] and list(h.backlog()) == ["b"]


def test_an_unanswered_tokenize_stops_holding_the_request_back(loop):
    h = held()
    lost = {0}
    h.alive = lambda w: w not in lost
    r, s = request(loop, "r1"), request(loop, "r2")
    h.hold(r, "model_not_resident", "b", worker=0, tokenizers=[0])
    h.hold(s, "model_not_resident", "b", worker=1, tokenizers=[1])
    assert h.backlog() == {"b": [r.wait_since_ns]}             # its worker is gone: counted
    assert h.backlog(now_ns=h.tokenizing["r2"][1] + h.tokenize_wait_ns + 1) == {"b": [r.wait_since_ns, s.wait_since_ns]}
    h.release(lambda model: [1])
    assert h.out["begun"] == [r] and h.held == [s]             # s's answer is still worth waiting for


def test_a_client_that_left_while_its_tokenize_was_out_is_closed_at_the_answer(loop):
    h = held()
    r = request(loop, "r1")
    h.hold(r, "model_not_resident", "b", worker=0, tokenizers=[0])
    r.cancelled = "disconnected"
    h.on_tokenized(r, 0, answer("r1", 5))
    assert h.out["left"] == [r] and h.held == [] and h.tokenizing == {} and r.tokenized is None


def test_a_request_tokenized_before_is_not_tokenized_again(loop):
    h = held()
    r = request(loop, "r1")
    r.tokenized = answer("r1", 5)
    h.hold(r, "model_not_resident", "b", worker=0, tokenizers=[0])
    assert h.proc.sent == [] and list(h.backlog()) == ["b"]


def test_an_answer_from_a_worker_lost_meanwhile_is_not_checked(loop):
    h = held()
    h.check = lambda r, msg, worker: pytest.fail("checked against the card of a worker no longer alive")
    r = request(loop, "r1")
    h.hold(r, "model_not_resident", "b", worker=0, tokenizers=[0])
    h.alive = lambda w: False
    h.on_tokenized(r, 0, answer("r1", 5))
    assert r.tokenized is None and h.held == [r] and h.tokenizing == {} and list(h.backlog()) == ["b"]
