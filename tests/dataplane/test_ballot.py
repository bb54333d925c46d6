"""The step ballot's verdict (dataplane/ballot.py): pure, the same on every rank that reads the
same posts; a split names the first sequence every rank holds whose digests differ."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import msgspec
import pytest

from residency.dataplane.ballot import (
    UNREADABLE, BallotUnreadable, decode_ballot, encode_ballot, judge, judge_posts, seq_digest,
)
from residency.events.commands import Generate, SamplingParams, StepBallot


def rnd_digest(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


def test_ballots_that_agree_run_the_ids_every_rank_holds_in_rank_0s_order():
    rng = random.Random()
    d = {i: rnd_digest(rng) for i in "abcd"}
    ballots = [StepBallot(ids=list("abcd"), digests=[d[i] for i in "abcd"]),
               StepBallot(ids=list("dca"), digests=[d[i] for i in "dca"]),
               StepBallot(ids=list("acd"), digests=[d[i] for i in "acd"])]
    v = judge(ballots)
    assert v.runs and v.agreed == ["a", "c", "d"] and v.split is None and v.digests == []


def test_a_split_names_the_first_agreed_id_in_rank_0s_order_with_every_ranks_digest():
    rng = random.Random()
    d = {i: rnd_digest(rng) for i in "abc"}
    other_c, other_b = rnd_digest(rng), rnd_digest(rng)
    ballots = [StepBallot(ids=list("abc"), digests=[d["a"], d["b"], d["c"]]),
               StepBallot(ids=list("cba"), digests=[other_c, d["b"], d["a"]]),
               StepBallot(ids=list("abc"), digests=[d["a"], other_b, d["c"]])]
    v = judge(ballots)
    assert not v.runs and v.agreed == ["a", "b", "c"]
    assert v.split == "b" and v.digests == [d["b"], d["b"], other_b]       # b comes before c in rank 0's order
    assert judge(list(ballots)) == v                                      # the same posts: the same verdict


def test_an_id_not_every_rank_holds_is_not_compared():
    rng = random.Random()
    b = rnd_digest(rng)
    ballots = [StepBallot(ids=["a", "b"], digests=[rnd_digest(rng), b]),
               StepBallot(ids=["b"], digests=[b]),                          # "a" has not reached rank 1 yet
               StepBallot(ids=["a", "b"], digests=[rnd_digest(rng), b])]    # rank 2's view of "a" differs
    v = judge(ballots)
    assert v.runs and v.agreed == ["b"]


def test_an_ids_only_post_reads_as_a_ballot_that_says_no_digest():
    rng = random.Random()
    posts = [json.dumps(["a", "b"]).encode(), encode_ballot(StepBallot(ids=["b", "a"], digests=[rnd_digest(rng),
                                                                                               rnd_digest(rng)]))]
    assert decode_ballot(posts[0], 0) == StepBallot(ids=["a", "b"])
    v = judge_posts(posts)
    assert v.runs and v.agreed == ["a", "b"]


@pytest.mark.parametrize("raw", [b"{\"ids\": 3}", b"not json", encode_ballot(StepBallot(ids=["a"], digests=["x", "y"]))])
def test_an_unreadable_post_is_a_split_on_every_rank_naming_the_rank(raw):
    good = encode_ballot(StepBallot(ids=["a"], digests=["d"]))
    with pytest.raises(BallotUnreadable, match="rank 1"):
        decode_ballot(raw, 1)
    v = judge_posts([good, raw, good])
    assert not v.runs and v.split == "" and v.digests == ["", UNREADABLE, ""]


def test_a_ballot_round_trips_through_the_stores_bytes():
    rng = random.Random()
    b = StepBallot(ids=[f"r{rng.randrange(1 << 30)}" for _ in range(5)], digests=[rnd_digest(rng) for _ in range(5)])
    assert decode_ballot(encode_ballot(b), 0) == b
    assert msgspec.json.decode(encode_ballot(b)) == [b.ids, b.digests]


def test_a_sequences_digest_covers_what_every_rank_must_hold_alike_and_not_what_it_times_alone():
    rng = random.Random()
    pages = rng.sample(range(1, 1 << 30), 5)
    tokens = [rng.randrange(49152) for _ in range(9)]
    cmd = Generate(request_id="r", session=None, token_ids=tokens[:7], block_ids=pages, num_cached_tokens=4,
                   sampling=SamplingParams(max_tokens=3), copy_from=[rng.randrange(1 << 20)], awaits_move="m1")

    def s(**kw):
        base = dict(cmd=cmd, tokens=list(tokens), num_computed=8)
        base.update(kw)
        return SimpleNamespace(**base)

    d = seq_digest(s(), "kv1")
    assert d == seq_digest(s(), "kv1")
    # a restore landed on one rank sooner, a page got another slot: timed alone, not compared
    assert d == seq_digest(s(awaits="", landing=None, num_allocated=2), "kv1")
    changed = [
        s(cmd=msgspec.structs.replace(cmd, block_ids=pages[:-1] + [pages[-1] + 1])),
        s(num_computed=7),
        s(tokens=tokens + [5]),
        s(tokens=tokens[:-1] + [tokens[-1] + 1]),
        s(cmd=msgspec.structs.replace(cmd, awaits_move="m2")),
        s(cmd=msgspec.structs.replace(cmd, copy_from=[])),
        s(cmd=msgspec.structs.replace(cmd, num_cached_tokens=0)),
    ]
    assert all(seq_digest(x, "kv1") != d for x in changed)
    assert seq_digest(s(), "kv2") != d                     # other weights
    # one sequence digested step after step (the command's part kept on it): what changes still shows
    one = s()
    assert seq_digest(one, "kv1") == d
    one.tokens.append(5)
    one.num_computed += 1
    assert seq_digest(one, "kv1") == seq_digest(s(tokens=tokens + [5], num_computed=9), "kv1") != d
    one.cmd = msgspec.structs.replace(cmd, block_ids=pages[:-1] + [pages[-1] + 1])
    assert seq_digest(one, "kv1") == seq_digest(s(cmd=one.cmd, tokens=tokens + [5], num_computed=9), "kv1")
    assert seq_digest(one, "kv1") != seq_digest(s(tokens=tokens + [5], num_computed=9), "kv1")
    assert seq_digest(one, "kv2") != seq_digest(one, "kv1")
