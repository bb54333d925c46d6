"""A tensor-parallel group as the control process decides for it (control/groups.py): one decision
for the leader, the same for every rank; a follower's own view never decides; step digests compared."""
from __future__ import annotations

import pytest

from residency.control.groups import GroupBook, StepDigests, step_digest
from residency.control.moves import InvalidAsk
from residency.control.policy.proposals import Proposal
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, Generate, SamplingParams, StepRefused, Tokenize


@pytest.fixture
def book():
    return GroupBook({"tp0": [0, 1, 2]})


def park(worker: int, session: str | None = "alice") -> Proposal:
    return Proposal(origin="operator:park", kind="park", worker=worker, src="device", dst="host", blocks=(4, 9, 11),
                    keep_source=False, session=session, reason="asked")


def test_a_move_for_the_leader_is_the_same_move_of_every_ranks_shard(book):
    ps = book.expand([park(0)])
    assert [p.worker for p in ps] == [0, 1, 2]
    assert {(p.kind, p.src, p.dst, p.blocks, p.keep_source) for p in ps} == {("park", "device", "host", (4, 9, 11), False)}
    # the session's facts (SessionParked) follow the leader's move only
    assert [p.session for p in ps] == ["alice", None, None]


def test_a_move_asked_of_a_follower_is_refused_naming_the_leader(book):
    with pytest.raises(InvalidAsk, match="rank 1 of group tp0.*worker 0"):
        book.expand([park(1)])
    assert book.for_policy(park(2)) == []          # a policy's view of a follower never decides
    assert [p.worker for p in book.for_policy(park(0))] == [0, 1, 2]


def test_serving_commands_to_the_leader_are_told_to_every_rank(book):
    gen = Generate(request_id="r", session=None, token_ids=[1, 2], block_ids=[5], num_cached_tokens=0,
                   sampling=SamplingParams(max_tokens=1))
    assert book.told_too(0, gen) == [1, 2]
    assert book.told_too(0, CancelGenerate(request_id="r", reason="x")) == [1, 2]
    assert book.told_too(0, Tokenize(request_id="r", prompt="hi")) == []      # the leader tokenizes alone
    assert book.told_too(1, gen) == []
    alone = GroupBook({})
    assert alone.told_too(0, gen) == [] and alone.expand([park(0)]) == [park(0)]


def test_a_hello_must_match_the_plan(book):
    assert book.check_hello(1, "tp0", 1, 3) is None
    assert "rank 1/3 of 'tp0'" in book.check_hello(2, "tp0", 1, 3)
    assert "in no group" in book.check_hello(7, "tp0", 0, 3)


def step(worker: int, n: int, batch: str = "b", tables: str = "t") -> ev.StepCompleted:
    return ev.StepCompleted(worker=worker, step=n, batch_digest=batch, num_seqs=1, num_tokens=1, duration_ns=1,
                            tables_digest=tables)


def test_a_step_whose_ranks_differ_is_a_divergence_with_every_ranks_digest(book):
    d = StepDigests(book)
    live = {0, 1, 2}
    for n in (1, 2):
        assert [d.observe(w, n, step_digest(step(w, n)), live) for w in (0, 1, 2)] == [None] * 3
    assert d.observe(0, 3, step_digest(step(0, 3)), live) is None
    assert d.observe(2, 3, step_digest(step(2, 3, tables="other")), live) is None     # rank 1 not in yet
    e = d.observe(1, 3, step_digest(step(1, 3)), live)
    assert type(e) is ev.GroupDiverged and e.group == "tp0" and e.step == 3
    assert e.digests_by_rank == {"0": "b/t", "1": "b/t", "2": "b/other"}


def test_a_lost_rank_is_not_waited_for(book):
    d = StepDigests(book)
    assert d.observe(0, 1, "x", {0, 2}) is None
    e = d.observe(2, 1, "y", {0, 2})
    assert e is not None and e.digests_by_rank == {"0": "x", "2": "y"}


def refused(worker: int, n: int, digests: list[str], rid: str = "cmpl-7") -> StepRefused:
    return StepRefused(worker=worker, round=n + 2, step=n, request_id=rid, digests_by_rank=digests)


def test_a_ballot_split_is_a_divergence_keyed_by_worker_and_caught_before_the_step():
    book = GroupBook({"tp0": [4, 5, 6]})
    d = StepDigests(book)
    e = d.ballot(5, refused(5, 1, ["aa", "aa", "bb"]))        # no step before it: judged at once
    assert type(e) is ev.GroupDiverged and (e.group, e.step, e.caught_by, e.round, e.request_id) == \
        ("tp0", 1, "ballot", 3, "cmpl-7")
    assert e.digests_by_rank == {"4": "aa", "5": "aa", "6": "bb"}
    assert d.ballot(9, refused(9, 1, ["x"])) is None          # a worker in no group


def test_a_ballot_split_waits_until_every_step_before_it_is_judged(book):
    d = StepDigests(book)
    live = {0, 1, 2}
    assert d.observe(2, 3, "s3", live) is None                # rank 2 sent step 3, then refused step 4's ballot
    assert d.ballot(2, refused(2, 4, ["x", "x", "y"])) is None        # ranks 0 and 1's step 3 not in yet: held
    assert d.observe(0, 3, "s3", live) is None
    assert d.observe(1, 3, "s3", live) is None                # step 3 agreed
    e = d.released("tp0")
    assert e is not None and e.step == 4 and e.caught_by == "ballot"
    assert d.released("tp0") is None                          # told once


def test_an_earlier_step_that_diverged_is_recorded_before_a_later_ballot_split(book):
    d = StepDigests(book)
    live = {0, 1, 2}
    d.observe(2, 3, "other", live)
    assert d.ballot(2, refused(2, 4, ["x", "x", "y"])) is None
    d.observe(0, 3, "s3", live)
    e = d.observe(1, 3, "s3", live)
    assert e is not None and e.step == 3 and e.caught_by == "step"      # the onset is the earlier step
