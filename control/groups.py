"""Tensor-parallel groups, as the control process decides for them (pure: no sockets, no clocks).

A group (``residency serve --tp N``) is N workers, one per rank; every rank holds its shard of
every block of the group. The control process decides once for the group and tells every rank
(docs/groups.md):

    the leader (rank 0)  is the worker the scheduler plans for: admission, batch membership and
                         order, block ids, prefix-match length, memory floors
    every rank           gets the same Generate / CancelGenerate (``told_too``) and its own
                         MoveRequested for its shard of each logical move (``expand``): one ask,
                         N moves, answered once all N have their outcome
    a follower           is never planned for on its own view: a policy's proposal for it is
                         dropped (``for_policy``), an operator's ask naming it is refused

``StepDigests`` compares the ranks' ``StepCompleted`` digests per step: the first mismatch is a
``GroupDiverged`` (every rank's digest) and the group stops (``GroupStopped``). The ranks also
compare their ballots before each step (dataplane/ballot.py); a split is told by every rank
(``StepRefused``), and is judged once every step before it was (``StepDigests.ballot``): the
earliest divergence is the one recorded.
"""
from __future__ import annotations

import msgspec

from residency.control.moves import InvalidAsk
from residency.control.policy.proposals import Proposal
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, Generate, StepRefused

TOLD_TO_EVERY_RANK = (Generate, CancelGenerate)
KEEP_STEPS = 64          # steps a rank may trail the others before its reports are judged without it


class GroupBook:
    """Which workers form which group, by rank (from ``serve --tp``'s plan)."""

    def __init__(self, groups: dict[str, list[int]]):
        self.members: dict[str, list[int]] = {g: list(ws) for g, ws in groups.items()}
        self.group_of: dict[int, str] = {w: g for g, ws in self.members.items() for w in ws}
        self.stopped: set[str] = set()          # groups that serve no more (GroupStopped recorded)

    def is_stopped(self, worker: int) -> bool:
        """``worker`` is a rank of a stopped group."""
        return self.group_of.get(worker) in self.stopped

    def leader(self, group: str) -> int:
        return self.members[group][0]

    def rank_of(self, worker: int) -> int:
        return self.members[self.group_of[worker]].index(worker)

    def is_follower(self, worker: int) -> bool:
        g = self.group_of.get(worker)
        return g is not None and self.members[g][0] != worker

    def followers(self, worker: int) -> list[int]:
        """The other ranks of the group ``worker`` leads ([] for a follower or a worker alone)."""
        g = self.group_of.get(worker)
        if g is None or self.members[g][0] != worker:
            return []
        return self.members[g][1:]

    def told_too(self, worker: int, msg) -> list[int]:
        """Who else gets ``msg`` sent to ``worker``: a serving command to a leader goes to every rank."""
        return self.followers(worker) if type(msg) in TOLD_TO_EVERY_RANK else []

    def check_hello(self, worker: int, group: str, rank: int, ranks: int) -> str | None:
        """A Hello's group fields against the plan: None if they agree, else why not."""
        g = self.group_of.get(worker)
        if g is None:
            return None if not group else f"worker {worker} says it is rank {rank} of {group!r}; it is in no group"
        want = (g, self.members[g].index(worker), len(self.members[g]))
        if (group, rank, ranks) != want:
            return f"worker {worker} says rank {rank}/{ranks} of {group!r}; the plan is rank {want[1]}/{want[2]} of {g!r}"
        return None

    def expand(self, proposals: list[Proposal]) -> list[Proposal]:
        """Each proposal for a leader, and the same move of the same blocks for each other rank (its
        shard). A proposal naming a follower is refused: a rank's own view never decides a move."""
        out: list[Proposal] = []
        for p in proposals:
            if self.is_follower(p.worker):
                g = self.group_of[p.worker]
                raise InvalidAsk(f"worker {p.worker} is rank {self.rank_of(p.worker)} of group {g}; ask its "
                                 f"leader, worker {self.leader(g)}: every rank moves its shard of the same blocks")
            out.append(p)
            out += [rank_copy(p, f) for f in self.followers(p.worker)]
        return out

    def for_policy(self, proposal: Proposal) -> list[Proposal]:
        """A policy's proposal as the group's moves ([]: it named a follower, whose view never decides)."""
        if self.is_follower(proposal.worker):
            return []
        return [proposal, *(rank_copy(proposal, f) for f in self.followers(proposal.worker))]


def rank_copy(p: Proposal, worker: int) -> Proposal:
    """``p`` for another rank's shard: the same blocks and tiers. The session's own facts (parked,
    restored) follow the leader's move, so a rank's copy names no session."""
    return msgspec.structs.replace(p, worker=worker, session=None, reason=p.reason or f"group:{p.kind}")


class StepDigests:
    """Every rank's digest of each step, compared once all ranks reported it."""

    def __init__(self, book: GroupBook):
        self.book = book
        self.pending: dict[str, dict[int, dict[int, str]]] = {}    # group -> step -> worker -> digest
        self.last: dict[str, int] = {}                             # group -> highest step judged
        self.held: dict[str, list[ev.GroupDiverged]] = {}          # group -> ballot splits awaiting earlier steps

    def observe(self, worker: int, step: int, digest: str, live: set[int]) -> ev.GroupDiverged | None:
        """``worker`` reported ``digest`` for ``step``; ``live``: the group's ranks still alive. A
        ``GroupDiverged`` when the step is complete and its digests differ, else None."""
        g = self.book.group_of.get(worker)
        if g is None:
            return None
        steps = self.pending.setdefault(g, {})
        steps.setdefault(step, {})[worker] = digest
        judged = None
        for s in sorted(steps):
            reports = steps[s]
            members = [w for w in self.book.members[g] if w in live]
            if all(w in reports for w in members) or s < step - KEEP_STEPS:
                del steps[s]
                if len(set(reports.values())) > 1 and judged is None:
                    judged = ev.GroupDiverged(group=g, step=s, digests_by_rank={str(w): d for w, d in
                                                                                sorted(reports.items())})
            else:
                break
        return judged

    def ballot(self, worker: int, refused: StepRefused) -> ev.GroupDiverged | None:
        """A rank's ballots split before ``refused.step``: its ``GroupDiverged``, once every step
        before it has been judged (each rank sent those steps' reports before it posted this
        ballot, but on its own socket), else held for ``released``. None for a worker in no group."""
        g = self.book.group_of.get(worker)
        if g is None:
            return None
        self.held.setdefault(g, []).append(ballot_diverged(self.book, g, refused))
        return self.released(g)

    def released(self, group: str) -> ev.GroupDiverged | None:
        """The earliest held ballot split of ``group`` whose earlier steps are all judged (None: none)."""
        held = self.held.get(group)
        if not held:
            return None
        first_open = min(self.pending.get(group, {}), default=None)
        ready = [d for d in held if first_open is None or first_open >= d.step]
        if not ready:
            return None
        self.held[group] = [d for d in held if d not in ready]
        return min(ready, key=lambda d: d.step)


def ballot_diverged(book: GroupBook, group: str, refused: StepRefused) -> ev.GroupDiverged:
    """A ballot split as the ledger records it: each rank's digest keyed by its worker id."""
    members = book.members[group]
    digests = {str(members[r]): d for r, d in enumerate(refused.digests_by_rank) if r < len(members)}
    return ev.GroupDiverged(group=group, step=refused.step, digests_by_rank=digests, caught_by="ballot",
                            round=refused.round, request_id=refused.request_id)


def step_digest(e: ev.StepCompleted) -> str:
    """What the ranks must agree on for a step: its batch and its block tables."""
    return f"{e.batch_digest}/{e.tables_digest}" if e.tables_digest else e.batch_digest


__all__ = ["GroupBook", "StepDigests", "ballot_diverged", "rank_copy", "step_digest", "TOLD_TO_EVERY_RANK"]
