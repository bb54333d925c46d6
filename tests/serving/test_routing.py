"""Which worker runs a request: the pure choice (``routing.py``) and, through a stack of two real
workers, a request moved to the worker whose session holds its prompt's opening pages."""
from __future__ import annotations

import random

import pytest

from residency.control.scheduler.routing import PREFIX_ROUTE_SLACK, by_load, by_prefix
from tests.serving.stack import P, stack  # noqa: F401 - the fixture
from tests.serving.test_service_sharing import SYSTEM


def test_by_load_takes_the_least_loaded_and_the_lowest_number_on_a_tie():
    assert by_load([0, 1, 2], {0: 3, 1: 1, 2: 1}) == 1
    assert by_load([2, 0], {}) == 0
    assert by_load([], {0: 1}) is None


def test_by_prefix_moves_a_request_to_the_pages_within_the_slack():
    assert by_prefix(1, {0: 40, 1: 0}, {0: 3, 1: 1}, slack=4) == 0
    assert by_prefix(1, {0: 40, 1: 0}, {0: 3, 1: 1}, slack=1) == 1          # worker 0 too far behind
    assert by_prefix(1, {0: 40, 1: 0}, {0: 1 + PREFIX_ROUTE_SLACK, 1: 1}) == 0
    assert by_prefix(1, {0: 40, 1: 0}, {0: 2 + PREFIX_ROUTE_SLACK, 1: 1}) == 1


def test_by_prefix_never_moves_a_request_for_nothing():
    assert by_prefix(1, {0: 0, 1: 0, 2: 0}, {}) == 1
    assert by_prefix(1, {0: 5, 1: 5}, {}) == 1                               # a tie stays
    assert by_prefix(0, {0: 5, 1: 9, 2: 9}, {}) == 1                         # the most, lowest number
    with pytest.raises(ValueError, match="worker 3 is not among the candidates"):
        by_prefix(3, {0: 1}, {})


def test_by_prefix_picks_the_most_pages_among_random_candidates_within_the_slack():
    rng = random.Random()
    for _ in range(300):
        n = rng.randint(1, 6)
        pages = {w: rng.randint(0, 50) for w in range(n)}
        load = {w: rng.randint(0, 10) for w in range(n)}
        here = rng.randrange(n)
        slack = rng.randint(0, 5)
        w = by_prefix(here, pages, load, slack)
        within = [v for v in pages if load[v] <= min(load.values()) + slack]
        best = max([pages[v] for v in within] + [pages[here]])
        assert pages[w] == best and (w == here or w in within)
        if pages[here] == best:
            assert w == here


def test_a_request_tokenized_on_one_worker_runs_where_its_prefix_is(stack):
    s = stack(workers=2, device_blocks=160)
    svc = s.service
    a = s.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    assert a.status_code == 200 and svc.workers.sched.sessions["a"].worker == 0
    first = svc.router.choose_worker

    def the_other(session, model=None):         # worker 1 tokenizes (as if worker 0 were busier)
        return 1 if session != "a" else first(session, model)
    svc.router.choose_worker = the_other
    ask = [SYSTEM, {"role": "user", "content": "second question"}]
    lone = s.chat(ask, max_tokens=8).json()                     # outside a session
    b = s.chat(ask, session="b", max_tokens=8).json()           # a new session
    other = s.chat([{"role": "user", "content": "nothing like it"}], max_tokens=4).json()
    opening = len("<system>" + SYSTEM["content"] + "<user>") // P * P
    assert lone["usage"]["shared_tokens"] >= opening and b["usage"]["shared_tokens"] >= opening
    assert svc.workers.sched.sessions["b"].worker == 0
    assert other["usage"]["shared_tokens"] == 0
    metrics = s.client.get("/metrics").text
    assert 'residency_requests_routed_total{reason="prefix"} 2.0' in metrics, metrics
    assert 'residency_requests_routed_total{reason="load"} 2.0' in metrics       # a's first turn, other
    # turned off with sharing: the same request stays where it was tokenized and computes it all
    off = stack(workers=2, device_blocks=160, share_prefixes=False)
    off.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    off.service.router.choose_worker = lambda session, model=None: 1
    ref = off.chat(ask, max_tokens=8).json()
    assert ref["usage"]["shared_tokens"] == 0
    assert lone["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] \
        == ref["choices"][0]["message"]["content"]
    s.close()
    events, _state = s.ledger()
    adm = [e for e in events if type(e).__name__ == "RequestAdmitted"]
    assert [(e.session, e.worker, e.routed_from) for e in adm] == \
        [("a", 0, None), (None, 0, 1), ("b", 0, 1), (None, 1, None)]
    off.close()
    assert [(e.worker, e.routed_from) for e in off.ledger()[0] if type(e).__name__ == "RequestAdmitted"] == \
        [(0, None), (1, None)]
