"""A control process that restarts with a flip in flight (issue #28): nobody verified what the
arena holds, so the flip is stranded with the arena's bytes and its rebind torn, before anything
else is decided; the ask socket carries AskFlip and its answer."""
from __future__ import annotations

import random

import msgspec

from residency.control import flip
from residency.events import catalog as ev
from residency.events.asks import AnyAsk, AnyAskReply, AskAnswered, AskFlip
from residency.events.codec import encode_message

from tests.control_plane.conftest import check_ledger, events_of


def test_a_restart_mid_flip_strands_the_arena_and_tears_its_rebind(make_control, sqlite_url):
    rng = random.Random(random.SystemRandom().randrange(2**32))
    nbytes = rng.randrange(1, 1 << 34)
    proc, store = make_control(sqlite_url)

    def begin(p):
        p.record(ev.WeightsLoaded(worker=0, arena="weights", model="a", bytes=nbytes))
        req, rebind = flip.requested(p.state, flip.FlipPlan(worker=0, action="sleep", from_model="a", to_model="",
                                                            level=1, bytes_out=nbytes, bytes_in=0),
                                     "fl-crash", from_gen=0, deadline_ns=0)
        p.record(req)
        p.record(rebind)
    proc.call(begin).result(5)
    proc.stop("crash")                     # no serving part runs here: nothing answers for the flip
    store.close()
    proc, store = make_control(sqlite_url)
    [failed] = [r.event for r in events_of(store, ev.FlipFailed)]
    assert failed.flip_id == "fl-crash" and failed.stranded and failed.stranded_bytes == nbytes
    [torn] = [r.event for r in events_of(store, ev.RebindTorn)]
    assert torn.rebind_id == "fl-crash" and sorted(torn.readers_behind) == [flip.ROUTER, flip.WORKER]
    state = check_ledger(store)
    assert state.arenas["0:weights"].stranded == "fl-crash" and state.flips == {}


def test_ask_flip_and_its_answer_cross_the_ask_socket():
    ask = AskFlip(ask_id="x", action="sleep", level=2)
    assert msgspec.msgpack.decode(encode_message(ask), type=AnyAsk) == ask
    ans = AskAnswered(ask_id="x", events=[ev.FlipFailed(flip_id="f", error="e", stranded=True, stranded_bytes=7)],
                      seqs=[3])
    assert msgspec.msgpack.decode(encode_message(ans), type=AnyAskReply) == ans
