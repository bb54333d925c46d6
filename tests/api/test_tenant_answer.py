"""The answer of a reclaim or release (control/api/tenant_routes.py ``answer_json``): a worker alone
answers with its one event; a tensor-parallel group's ranks each record theirs, and the answer is
the group's sum, measured only when every rank was (null, never a partial sum or 0)."""
from __future__ import annotations

import random

from residency.control.api.tenant_routes import answer_json
from residency.control.cli.ctl_cmd import describe_group
from residency.events import catalog as ev
from residency.events.asks import AskAnswered


def _grants(measured: list[int | None], shard: int, pages: int) -> list[ev.TenantReclaimed]:
    return [ev.TenantReclaimed(tenant="trainer", worker=w, asked_bytes=pages * shard * len(measured) - 7,
                               granted_bytes=pages * shard, freed_bytes=(w + 1) * shard, measured_bytes=m,
                               rebind_id=f"rb-1-1.r{w}", moves=[f"m{w}"], sessions=["alice"])
            for w, m in enumerate(measured)]


def test_a_group_s_reclaim_answers_the_sum_of_its_ranks_and_lists_each():
    shard, pages = random.randrange(1000, 9000), random.randrange(2, 9)
    measured = [random.randrange(1, 10**6) for _ in range(3)]
    grants = _grants(measured, shard, pages)
    status, body = answer_json(AskAnswered(ask_id="a", events=grants, seqs=[10, 11, 12]))
    assert status == 200 and body["worker"] == 0 and body["seq"] == 10
    assert body["granted_bytes"] == 3 * pages * shard and body["freed_bytes"] == 6 * shard
    assert body["measured_bytes"] == sum(measured) and body["moves"] == ["m0", "m1", "m2"]
    assert [(r["worker"], r["granted_bytes"], r["measured_bytes"]) for r in body["ranks"]] == [
        (w, pages * shard, m) for w, m in enumerate(measured)]
    line = describe_group(grants)
    assert "workers 0, 1, 2" in line and "not measured" not in line


def test_one_unmeasured_rank_makes_the_group_s_figure_null_never_a_partial_sum():
    grants = _grants([random.randrange(1, 10**6), None, random.randrange(1, 10**6)], 4096, 3)
    _, body = answer_json(AskAnswered(ask_id="a", events=grants, seqs=[1, 2, 3]))
    assert body["measured_bytes"] is None and body["granted_bytes"] == 3 * 3 * 4096
    assert "not measured" in describe_group(grants)
    released = [ev.TenantReleased(tenant="t", worker=w, bytes=3 * 4096, measured_bytes=None, rebind_id=f"r{w}")
                for w in range(3)]
    _, body = answer_json(AskAnswered(ask_id="b", events=released, seqs=[4, 5, 6]))
    assert body["bytes"] == 9 * 4096 and body["measured_bytes"] is None and len(body["ranks"]) == 3


def test_a_worker_alone_answers_with_its_own_event_and_no_group_line():
    [grant] = _grants([None], 5000, 4)
    _, body = answer_json(AskAnswered(ask_id="a", events=[grant], seqs=[3]))
    assert body["granted_bytes"] == 4 * 5000 and body["measured_bytes"] is None and len(body["ranks"]) == 1
    assert describe_group([grant]) == ""
