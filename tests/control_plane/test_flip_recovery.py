"""A control process that restarts with a flip in flight (issue #28): nobody verified what the
arena holds, so the flip is stranded with the arena's bytes and its rebind torn, before anything
else is decided; the ask socket carries AskFlip and its answer."""
from __future__ import annotations

import random
from types import SimpleNamespace

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


def test_a_wake_after_a_restart_grows_the_kv_pool_to_the_size_the_sleep_took_it_from(make_control, sqlite_url):
    """The sleep's FlipRequested carries the pool's size before its shrink into the ledger; a control
    restarted while the worker sleeps (its loop's memory gone) asks the dial to grow the pool back
    to that size when the wake completes."""
    from residency.control import moves
    from residency.control.flipping import Flipper, Run

    rng = random.Random(random.SystemRandom().randrange(2**32))
    block = 1 << 20
    before = rng.randrange(8, 64) * block
    nbytes = rng.randrange(1, 1 << 34)
    proc, store = make_control(sqlite_url)

    def slept(p):
        p.record(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": before, "host": 4 * before, "disk": 0},
                                 block_bytes=block))
        p.record(ev.WeightsLoaded(worker=0, arena="weights", model="a", bytes=nbytes))
        p.record(ev.PoolResized(worker=0, pool="device", from_bytes=before, to_bytes=block, gen=1))
        plan = flip.FlipPlan(worker=0, action="sleep", from_model="a", to_model="", level=1, bytes_out=nbytes,
                             bytes_in=0)
        req, rebind = flip.requested(p.state, plan, "fl-sleep", from_gen=0, deadline_ns=0, kv_pool_bytes=before)
        for e in (req, rebind, *(ev.ReaderStamped(rebind_id="fl-sleep", reader=r, gen=req.to_gen)
                                 for r in (flip.ROUTER, flip.WORKER)), ev.RebindCommitted(rebind_id="fl-sleep")):
            p.record(e)
        p.record(ev.FlipCompleted(flip_id="fl-sleep", worker=0, bytes_out=nbytes, bytes_in=0, started_ns=1,
                                  finished_ns=2, overlapped_steps=0, checksum_ok=True, to_gen=req.to_gen))
    proc.call(slept).result(5)
    proc.stop("crash")
    store.close()
    proc, store = make_control(sqlite_url)
    asked = []

    def wake(p):
        assert p.state.arenas["0:weights"].kv_pool_bytes == before
        real = p.dial

        class Spy:              # the edge: what the flipper asks of the dial (the real dial still answers)
            def resize(self, worker, pool, to_bytes, origin, waiter, causation=None, sleeping=False):
                asked.append((worker, pool, to_bytes, sleeping))
                real.resize(worker, pool, to_bytes, origin, waiter, causation=causation, sleeping=sleeping)
        p.dial = Spy()
        f = Flipper(p, workers=SimpleNamespace(ready={}), requests=SimpleNamespace(by_id={}), asker=None)
        plan = flip.FlipPlan(worker=0, action="wake", from_model="", to_model="a", level=1, bytes_out=0,
                             bytes_in=nbytes)
        run = Run(plan, "api:wake", moves.AskWaiter("w", lambda *a: None), "w", 0, None)
        f.runs[0] = run
        grew = f._grow(run)
        p.dial = real
        return grew
    assert proc.call(wake).result(5) is True
    assert asked == [(0, "device", before, False)]     # a wake's grow: the context floor applies
