"""Requests running when the control process died are closed by the next one: each admitted and
never finished request gets RequestFinished(reason="control_lost") after the new ServerStarted,
so nothing waits for an answer that cannot come (and diagnose sees no phantom stall)."""
from __future__ import annotations

import random

from residency.events import catalog as ev
from residency.events.envelope import Envelope

from tests.control_plane.conftest import events_of


def test_requests_open_when_the_control_died_are_closed_at_the_next_start(make_control, sqlite_url):
    rng = random.Random()
    proc, store = make_control(sqlite_url)
    proc.stop("setup")
    # what a killed control left: requests admitted, one finished, the rest never
    ids = [f"req-{rng.randrange(1 << 40):x}" for _ in range(rng.randint(2, 6))]
    finished = rng.choice(ids)
    base = store.last_seq()
    items = [ev.ServerStarted(version="0.1.0", config_digest="x")]
    items += [ev.RequestAdmitted(request_id=r, session=None, prompt_tokens=rng.randint(1, 99)) for r in ids]
    items.append(ev.RequestFinished(request_id=finished, reason="stop", completion_tokens=rng.randint(1, 50)))
    store.append([(Envelope(producer="crashed", epoch=1, producer_seq=i + 1, ts_ns=base + i + 1), e)
                  for i, e in enumerate(items)])

    proc, store = make_control(sqlite_url)
    proc.stop("checked")
    rows = [r for r in store.read() if r.seq > base + len(items)]
    started = next(i for i, r in enumerate(rows) if type(r.event) is ev.ServerStarted)
    closed = [r for r in rows if type(r.event) is ev.RequestFinished]
    assert sorted(r.event.request_id for r in closed) == sorted(set(ids) - {finished})
    assert all(r.event.reason == "control_lost" and r.event.completion_tokens == 0 for r in closed)
    assert all(r.seq > rows[started].seq and r.envelope.correlation_id == r.event.request_id for r in closed)
    from residency.control.replay import replay
    assert replay(store)[0].requests == {}
    # a clean restart finds nothing to close
    proc, store = make_control(sqlite_url)
    proc.stop("again")
    assert len(events_of(store, ev.RequestFinished)) == len(closed) + 1
