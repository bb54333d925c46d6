"""The rounds on which the ranks of a group agree each step (dataplane/group.py), over a real
TCPStore with two ranks in threads; the serving loop is a stand-in that records what it was asked to run."""
from __future__ import annotations

import datetime
import random
import socket
import threading
from types import SimpleNamespace

import pytest

from residency.dataplane.faults import WorkerFaults, rank_faults as rank_faults_apply
from residency.dataplane.group import GroupLoop, StepRounds, agreed_order, tables_digest
from residency.events.commands import CancelGenerate, Generate, SamplingParams, StepRefused

torch_dist = pytest.importorskip("torch.distributed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stores():
    port = _port()
    t = datetime.timedelta(seconds=10)
    master = torch_dist.TCPStore("127.0.0.1", port, 2, True, timeout=t, wait_for_workers=False)
    peer = torch_dist.TCPStore("127.0.0.1", port, 2, False, timeout=t)
    return master, peer


def told(rid: str, pages: list[int] | None = None) -> Generate:
    pages = pages if pages is not None else random.Random(rid).sample(range(1, 1 << 20), 3)
    return Generate(request_id=rid, session=None, token_ids=[11, 12], block_ids=pages, num_cached_tokens=0,
                    sampling=SamplingParams(max_tokens=1))


def seq(cmd: Generate) -> SimpleNamespace:
    """What the ballot reads of a serving loop's sequence (dataplane/serving.py ``_Seq``)."""
    return SimpleNamespace(cmd=cmd, request_id=cmd.request_id, tokens=list(cmd.token_ids),
                           num_computed=cmd.num_cached_tokens)


class FakeLoop:
    """The edge: what a ServingLoop exposes to GroupLoop (seqs in arrival order, step, handle)."""

    def __init__(self, ids, worker: int = 0):
        self.seqs = {i: seq(told(i)) for i in ids}
        self.worker = worker
        self.ran: list[list[str]] = []
        self.handled: list = []
        self.num_steps = 0
        self.agree_tokens = None

    def step(self, only):
        self.ran.append(list(only))
        self.num_steps += 1
        return [("tokens", self.agree_tokens([len(self.ran) * 10 + len(only)]))]

    def handle(self, msg):
        self.handled.append(msg)
        self.seqs.pop(msg.request_id, None)
        return [("cancelled", msg.request_id)]


def both(a, b):
    """Run a() and b() at once (the two ranks); their results."""
    out = {}
    ts = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f())) for k, f in (("a", a), ("b", b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return out["a"], out["b"]


def test_a_step_runs_only_what_every_rank_holds_in_the_first_ranks_order():
    assert agreed_order([["a", "b", "c"], ["c", "a"]]) == ["a", "c"]
    assert agreed_order([["a", "b"], []]) == []
    assert agreed_order([["x"], ["x"], ["y", "x"]]) == ["x"]


def test_two_ranks_agree_on_the_min_and_the_tokens_of_rank_0(stores):
    l0, l1 = FakeLoop(["r1", "r2"]), FakeLoop(["r1"])         # r2 has not reached rank 1 yet
    g0, g1 = GroupLoop(l0, StepRounds(stores[0], 0, 2)), GroupLoop(l1, StepRounds(stores[1], 1, 2))
    out0, out1 = both(g0.step, g1.step)
    assert l0.ran == l1.ran == [["r1"]]
    assert out0 == out1 == [("tokens", [11])]                  # rank 1 took rank 0's tokens


def test_a_rank_with_nothing_answers_a_round_a_peer_opened(stores):
    l0, l1 = FakeLoop(["r1"]), FakeLoop([])
    g0, g1 = GroupLoop(l0, StepRounds(stores[0], 0, 2, wait_s=0.01)), GroupLoop(l1, StepRounds(stores[1], 1, 2))
    assert not g1.has_work()
    assert g0.step() == []              # rank 1 has not posted: rank 0 goes back to its commands
    assert g1.has_work()                # ... and rank 1 sees the round open
    assert g1.step() == [] and g0.step() == []      # an empty agreement runs no forward anywhere
    assert l0.ran == l1.ran == []
    assert g0.rounds.round == g1.rounds.round == 1


def test_a_cancel_after_the_post_waits_until_that_round_ran(stores):
    l0, l1 = FakeLoop(["r1"]), FakeLoop(["r1"])
    g0, g1 = GroupLoop(l0, StepRounds(stores[0], 0, 2, wait_s=0.01)), GroupLoop(l1, StepRounds(stores[1], 1, 2))
    assert g0.step() == []                                    # rank 0 posted r1; rank 1 not yet
    cancel = CancelGenerate(request_id="r1", reason="disconnected")
    assert g0.handle(cancel) == [] and "r1" in l0.seqs        # deferred: its post named r1
    assert g1.handle(cancel) == [("cancelled", "r1")]         # rank 1 had not posted: at once
    out0, out1 = both(g0.step, g1.step)
    assert l0.ran == [] and l1.ran == []                      # rank 1 no longer holds r1: not run
    assert out0 == [("cancelled", "r1")] and "r1" not in l0.seqs


def test_the_tables_digest_names_every_page_of_every_sequence():
    a = tables_digest([("r1", [1, 2, 3]), ("r2", [7])])
    assert a == tables_digest([("r1", [1, 2, 3]), ("r2", [7])])
    assert a != tables_digest([("r1", [1, 2, 4]), ("r2", [7])])
    assert a != tables_digest([("r2", [7]), ("r1", [1, 2, 3])])


def test_a_fault_spec_part_applies_to_its_rank_only():
    spec = "on_rank=1,drop_ack=1;on_rank=2,diverge_table=3;seed=4"
    assert rank_faults_apply(spec, 0) == "seed=4"
    assert rank_faults_apply(spec, 1) == "on_rank=1,drop_ack=1,seed=4"
    assert rank_faults_apply(spec, 2) == "on_rank=2,diverge_table=3,seed=4"


class Told(FakeLoop):
    def handle(self, msg):
        if isinstance(msg, Generate):
            self.seqs[msg.request_id] = seq(msg)
            return []
        return super().handle(msg)


def test_the_diverge_fault_changes_one_page_of_the_nth_sequence_before_its_first_step(stores):
    faults = WorkerFaults("diverge_table=2")
    loop = Told([])
    g = GroupLoop(loop, StepRounds(stores[0], 0, 1), faults)      # a group of one: its own post agrees
    for rid, pages in (("a", [3, 4]), ("b", [7, 8, 9])):
        g.handle(Generate(request_id=rid, session=None, token_ids=[1, 2], block_ids=pages, num_cached_tokens=0,
                          sampling=SamplingParams(max_tokens=1)))
    g.step()
    assert loop.ran == [["a", "b"]]
    assert loop.seqs["a"].cmd.block_ids == [3, 4]
    assert loop.seqs["b"].cmd.block_ids == [7, 8, 9 + (1 << 40)] and faults.counts == {"diverge_table": 1}
    g.step()
    assert loop.seqs["b"].cmd.block_ids == [7, 8, 9 + (1 << 40)]     # once


def test_ranks_whose_views_of_a_sequence_differ_run_no_step_and_tell_one_verdict(stores):
    pages = random.Random().sample(range(1, 1 << 30), 4)
    l0, l1 = FakeLoop([], worker=0), FakeLoop([], worker=5)
    l0.seqs["r1"] = seq(told("r1", pages))
    l1.seqs["r1"] = seq(told("r1", pages[:-1] + [pages[-1] + 1]))       # rank 1's table differs by one page
    g0, g1 = GroupLoop(l0, StepRounds(stores[0], 0, 2)), GroupLoop(l1, StepRounds(stores[1], 1, 2))
    (a,), (b,) = both(g0.step, g1.step)
    assert l0.ran == l1.ran == []                               # no rank entered the step
    assert type(a) is type(b) is StepRefused and (a.worker, b.worker) == (0, 5)
    assert (a.round, a.step, a.request_id) == (b.round, b.step, b.request_id) == (0, 1, "r1")
    assert a.digests_by_rank == b.digests_by_rank and len(set(a.digests_by_rank)) == 2
    # the group is stopped: the ranks post no more rounds and a cancel frees the sequence at once
    assert not g0.has_work() and not g1.has_work() and g0.step() == [] == g1.step()
    assert g0.rounds.round == g1.rounds.round == 1 and not stores[0].check(["r1/0"])
    assert g1.handle(CancelGenerate(request_id="r1", reason="group_stopped")) == [("cancelled", "r1")]


def test_the_ballot_fault_splits_the_nth_sequence_only_and_names_it(stores):
    l0, l1 = Told([], worker=0), Told([], worker=1)
    g0 = GroupLoop(l0, StepRounds(stores[0], 0, 2))
    faults = WorkerFaults("on_rank=1,diverge_ballot=2")
    g1 = GroupLoop(l1, StepRounds(stores[1], 1, 2), faults)
    for rid in ("a", "b"):
        cmd = told(rid)
        g0.handle(cmd)
        g1.handle(cmd)
    (a,), (b,) = both(g0.step, g1.step)
    assert l0.ran == l1.ran == []
    assert a.request_id == b.request_id == "b" and a.digests_by_rank == b.digests_by_rank    # "a" agreed
    assert faults.counts == {"diverge_ballot": 1} and faults.enabled


def test_without_the_ballot_fault_the_same_sequences_run(stores):
    l0, l1 = Told([], worker=0), Told([], worker=1)
    g0, g1 = GroupLoop(l0, StepRounds(stores[0], 0, 2)), GroupLoop(l1, StepRounds(stores[1], 1, 2))
    for rid in ("a", "b"):
        cmd = told(rid)
        g0.handle(cmd)
        g1.handle(cmd)
    both(g0.step, g1.step)
    assert l0.ran == l1.ran == [["a", "b"]] and g0.refused is None is g1.refused


def test_the_table_fault_lands_after_the_ballots_agreed_so_that_step_runs_and_the_next_ballots_split(stores):
    l0, l1 = Told([], worker=0), Told([], worker=1)
    g0 = GroupLoop(l0, StepRounds(stores[0], 0, 2))
    g1 = GroupLoop(l1, StepRounds(stores[1], 1, 2), WorkerFaults("on_rank=1,diverge_table=1"))
    cmd = told("a")
    g0.handle(cmd)
    g1.handle(cmd)
    both(g0.step, g1.step)
    assert l0.ran == l1.ran == [["a"]]                  # the ballots agreed; rank 1's table changed after
    (a,), (b,) = both(g0.step, g1.step)
    assert l0.ran == l1.ran == [["a"]]                  # the next step ran nowhere
    assert a.request_id == b.request_id == "a" and (a.round, a.step) == (b.round, b.step) == (1, 2)
