"""A worker that is one rank of a tensor-parallel group (``residency serve --tp N``).

The control process decides once for the whole group and tells every rank the same thing:
which requests run (Generate, CancelGenerate), which block ids they write, which moves each
rank makes of its shard. What a rank still decides locally is *when* a command it has received
joins a forward step, because the commands reach the ranks at slightly different times. That is
agreed here, step by step, over the group's store (docs/groups.md):

    round k:   each rank posts its ballot: the request ids it could run, in arrival order (the
               control sends every rank its commands in one order, so arrival order is one
               canonical order), each with its digest of what it would run for that sequence
               ─► the step runs the ids that EVERY rank posted (the MIN over ranks), in rank 0's
                  order, if every rank's digest of each agrees (dataplane/ballot.py); if one
                  differs, NO rank runs it: each tells the control (StepRefused) and steps no more
               ─► the sampled tokens are rank 0's, told to the others (one decision, told)

A rank with nothing to run still answers a round a peer opened (it posts an empty ballot), so no
rank ever waits in a collective that a peer does not enter: the forward (and its all-reduces)
runs only on a batch that every rank has agreed to. A cancel that arrives after a rank posted
its round waits until that round has run, so the posted list stays true.

The rendezvous: one TCPStore, served by rank 0 at ``--group-store HOST:PORT``, carries the
rounds; the process group of the model's collectives (dataplane/model/tp.py ``init_group``: gloo
on a CPU, NCCL on CUDA, one device per rank: ``cuda:<rank>``) rendezvouses at ``--group-init
tcp://HOST:PORT``.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass

import structlog

from residency.dataplane.ballot import Verdict, agreed_order, encode_ballot, judge_posts, seq_digest
from residency.dataplane.sizing import StartRefused
from residency.events.commands import CancelGenerate, Generate, StepBallot, StepRefused

log = structlog.get_logger("dataplane.group")
ROUND_WAIT_S = 0.05        # how long a step waits for its peers' posts before the loop reads commands again
RENDEZVOUS_S = 60.0        # a rank whose peers never come gives up (its process exits; the supervisor sees it)


class GroupRefused(StartRefused):
    """The model cannot be split over the group's ranks; the message has the arithmetic. The
    worker exits as one whose pool does not fit, and ``residency serve`` stops with the message."""


@dataclass(frozen=True)
class GroupSpec:
    name: str
    rank: int
    ranks: int
    init: str          # tcp://HOST:PORT of the process group's rendezvous
    store: str         # HOST:PORT of the rounds' store (rank 0 serves it)

    def hello_fields(self) -> dict:
        return {"group": self.name, "rank": self.rank, "ranks": self.ranks}


def group_spec(args) -> GroupSpec | None:
    """The group named by the worker's command line, or None (a worker alone)."""
    ranks = getattr(args, "ranks", 1) or 1
    if ranks <= 1:
        return None
    if not 0 <= args.rank < ranks:
        raise ValueError(f"--rank {args.rank} is not in [0, {ranks})")
    if not args.group_init or not args.group_store:
        raise ValueError("--ranks > 1 needs --group-init tcp://HOST:PORT and --group-store HOST:PORT")
    return GroupSpec(name=args.group or "tp0", rank=args.rank, ranks=ranks, init=args.group_init,
                     store=args.group_store)


def add_group_args(p) -> None:
    g = p.add_argument_group("tensor-parallel group (serve --tp N)")
    g.add_argument("--group", default="", help="the group's name")
    g.add_argument("--rank", type=int, default=0, help="this worker's rank in the group")
    g.add_argument("--ranks", type=int, default=1, help="ranks in the group (1: a worker alone)")
    g.add_argument("--group-init", default="", help="tcp://HOST:PORT where the process group rendezvouses")
    g.add_argument("--group-store", default="", help="HOST:PORT of the store the ranks agree their steps on")


def open_store(spec: GroupSpec):
    """The rounds' store: rank 0 serves it, the others connect (a rank waits at most RENDEZVOUS_S)."""
    from torch.distributed import TCPStore  # noqa: PLC0415

    host, _, port = spec.store.rpartition(":")
    return TCPStore(host, int(port), spec.ranks, spec.rank == 0, timeout=datetime.timedelta(seconds=RENDEZVOUS_S),
                    wait_for_workers=False)


def tables_digest(tables: list[tuple[str, list[int]]]) -> str:
    """A digest of a step's block tables: each sequence's logical page ids, in batch order."""
    text = ";".join(f"{rid}:{','.join(map(str, ids))}" for rid, ids in tables)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class StepRounds:
    """The rounds over the store (one per step the group may take)."""

    def __init__(self, store, rank: int, ranks: int, wait_s: float = ROUND_WAIT_S):
        self.store, self.rank, self.ranks, self.wait_s = store, rank, ranks, wait_s
        self.round = 0

    def _key(self, k: int, r: int) -> str:
        return f"r{k}/{r}"

    def post(self, ballot: StepBallot) -> None:
        self.store.set(self._key(self.round, self.rank), encode_ballot(ballot))
        old = self.round - 2         # every rank has read round k-2: each posted k-1 after reading it
        if old >= 0:
            self.store.delete_key(self._key(old, self.rank))
            if self.rank == 0:
                self.store.delete_key(f"t{old}")

    def peer_opened(self) -> bool:
        """A peer posted the current round (this rank must answer it, even with nothing)."""
        return any(self.store.check([self._key(self.round, r)]) for r in range(self.ranks) if r != self.rank)

    def gather(self) -> list[bytes] | None:
        """Every rank's post of the current round as stored (by rank), or None when one is not
        there within wait_s."""
        keys = [self._key(self.round, r) for r in range(self.ranks)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.wait_s))
        except RuntimeError:          # the store's timeout (DistStoreError is one)
            return None
        return [bytes(v) for v in self.store.multi_get(keys)]     # one round trip for all

    def tell_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens of this round, told to every rank."""
        key = f"t{self.round}"
        if self.rank == 0:
            self.store.set(key, json.dumps(tokens))
            return tokens
        return json.loads(self.store.get(key))

    def done(self) -> None:
        self.round += 1


class GroupLoop:
    """A serving loop as one rank of a group: its steps agreed with the other ranks."""

    def __init__(self, loop, rounds: StepRounds, faults=None, admit=None):
        self.loop = loop
        self.admit = admit or loop.handle           # how a Generate reaches the loop (a gate may answer it)
        self.rounds = rounds
        self.faults = faults
        self.posted: list[str] | None = None       # this round's post, until the round runs
        self.cancel_after: list[CancelGenerate] = []
        self.store_error: str | None = None        # the store failed (logged once)
        self.num_started = 0                       # Generates this rank was told
        self.diverge_id: str | None = None         # the sequence the diverge_table fault picked
        self.ballot_fault_id: str | None = None    # the sequence the diverge_ballot fault picked
        self.fail_id: str | None = None            # the sequence the fail_seq fault picked
        self.refused: StepRefused | None = None    # the ballots split: this rank steps no more
        loop.agree_tokens = self._tell

    def has_work(self) -> bool:
        if self.refused is not None:
            return False              # the group is stopped: only the control's cancels still come
        if self.loop.seqs or self.posted is not None:
            return True
        try:
            return self.rounds.peer_opened()
        except Exception as e:  # noqa: BLE001 - the store is gone with rank 0: nothing to answer
            if self.store_error is None:
                self.store_error = repr(e)
                log.error("group_store_unreachable", error=self.store_error)
            return False

    def handle(self, msg) -> list:
        if isinstance(msg, Generate):
            self.num_started += 1
            if self.faults is not None and self.faults.diverge_table == self.num_started:
                self.diverge_id = msg.request_id
            if self.faults is not None and self.faults.diverge_ballot == self.num_started:
                self.ballot_fault_id = msg.request_id
            if self.faults is not None and self.faults.fail_seq == self.num_started:
                self.fail_id = msg.request_id
            return self.admit(msg)
        elif isinstance(msg, CancelGenerate) and self.posted is not None and msg.request_id in self.posted:
            self.cancel_after.append(msg)     # the posted round names it: it runs that round first
            return []
        return self.loop.handle(msg)

    def step(self) -> list:
        if self.refused is not None:
            return []
        failed = self._fail_fault()
        if self.posted is None:
            self.posted = list(self.loop.seqs)
            self.rounds.post(self._ballot(self.posted))
        posts = self.rounds.gather()
        if posts is None:
            return []                 # a peer has not posted yet: read commands, try again
        verdict = judge_posts(posts)  # the same posts on every rank: the same verdict
        out: list = []
        try:
            if not verdict.runs:
                out = [self._refuse(verdict)]
            elif verdict.agreed:
                self._inject(verdict.agreed)
                out = self.loop.step(only=verdict.agreed)
        finally:        # the round is spent either way: the next one is posted afresh by every rank
            self.posted = None
            self.rounds.done()
        for c in self.cancel_after:
            out += self.loop.handle(c)
        self.cancel_after = []
        return failed + out

    def _fail_fault(self) -> list:
        """The ``fail_seq`` fault: this rank alone fails the sequence, before its first step, as a
        restore of its own shard that failed its checksum would. The sequence leaves this rank's
        posts; the control, told by its error report, cancels it on the peers."""
        if self.fail_id is None or self.fail_id not in self.loop.seqs or self.posted is not None:
            return []
        rid, self.fail_id = self.fail_id, None
        self.faults.counts["fail_seq"] = 1
        log.warning("fault_injected_sequence_failure", fault="fail_seq", request_id=rid)
        return self.loop.fail(rid, "fault fail_seq: this rank failed the sequence alone")

    def _ballot(self, ids: list[str]) -> StepBallot:
        """This rank's ballot: each id with its digest of what it would run for that sequence."""
        model = getattr(self.loop, "model_digest", "")
        digests = [seq_digest(self.loop.seqs[i], model) for i in ids]
        if self.ballot_fault_id in ids:       # the diverge_ballot fault: this rank's view of it differs
            j = ids.index(self.ballot_fault_id)
            digests[j] = hashlib.blake2b(f"fault:{digests[j]}".encode(), digest_size=8).hexdigest()
            self.faults.counts["diverge_ballot"] = self.faults.counts.get("diverge_ballot", 0) + 1
            log.warning("fault_injected_divergence", fault="diverge_ballot", round=self.rounds.round,
                        request_id=self.ballot_fault_id)
        return StepBallot(ids=list(ids), digests=digests)

    def _refuse(self, verdict: Verdict) -> StepRefused:
        """The ballots split: this rank runs no step from now on (no collective on inputs that
        differ) and tells the control, which stops the group; its sequences wait for the cancels."""
        self.refused = StepRefused(worker=self.loop.worker, round=self.rounds.round, step=self.loop.num_steps + 1,
                                   request_id=verdict.split or "", digests_by_rank=list(verdict.digests))
        log.error("group_step_refused", round=self.refused.round, step=self.refused.step,
                  request_id=self.refused.request_id, digests=self.refused.digests_by_rank)
        return self.refused

    def _tell(self, tokens: list[int]) -> list[int]:
        return self.rounds.tell_tokens([int(t) for t in tokens])

    def _inject(self, agreed: list[str]) -> None:
        """The ``diverge_table`` fault: this rank's copy of the block table of the Nth sequence it
        was told to run takes a page id no other rank has, before that sequence's first step, so
        the step's tables digest differs (dataplane/faults.py)."""
        if self.diverge_id is None or self.diverge_id not in agreed:
            return
        import msgspec  # noqa: PLC0415

        s = self.loop.seqs[self.diverge_id]
        self.diverge_id = None
        ids = list(s.cmd.block_ids)
        ids[-1] = ids[-1] + (1 << 40)
        s.cmd = msgspec.structs.replace(s.cmd, block_ids=ids)
        self.faults.counts["diverge_table"] = 1
        log.warning("fault_injected_divergence", fault="diverge_table", step=self.loop.num_steps + 1,
                    request_id=s.request_id)


__all__ = ["GroupRefused", "GroupSpec", "GroupLoop", "StepRounds", "agreed_order", "tables_digest", "group_spec",
           "add_group_args", "open_store"]
