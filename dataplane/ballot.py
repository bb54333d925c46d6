"""A group's step ballot: what each rank would run, compared before any rank runs it (pure).

Before each step every rank of a group posts a ``StepBallot`` to the group's store: the request
ids it could run, in arrival order, and for each its digest of what it would run for that
sequence. Every rank reads every rank's ballot, so every rank computes the same ``Verdict``:

    ballots ─► agreed: the ids EVERY rank posted, in rank 0's order (the MIN over ranks)
            ─► split:  the first agreed id whose ranks' digests differ, or None
               split is None  → the step runs the agreed ids on every rank
               split is set   → no rank runs it (no collective is entered on inputs that differ);
                                the group stops, and each rank tells the control (StepRefused)

A rank's digest of a sequence covers what the rank holds locally and that every rank must hold
alike: the block table of logical page ids, the positions computed and the tokens known (and the
last of them, the next step's input), the cached prefix and the pages it copies, the restore it
awaits, and the weights it serves. Things a rank times on its own (whether that restore has landed
yet, which pool slot a page got) are left out: they may differ without the step differing.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec

from residency.events.serving import StepBallot

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StepBallot).decode
_decode_ids = msgspec.json.Decoder(list[str]).decode


class BallotUnreadable(ValueError):
    """A rank's post on the group's store is neither a ballot nor a list of ids."""


def encode_ballot(ballot: StepBallot) -> bytes:
    return _encode(ballot)


def decode_ballot(raw: bytes, rank: int) -> StepBallot:
    """A rank's post. An ids-only post (a bare JSON list) reads as a ballot whose digests are not
    said. Raises BallotUnreadable naming the rank for anything else."""
    try:
        b = _decode(raw)
    except msgspec.ValidationError:
        try:
            return StepBallot(ids=_decode_ids(raw))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise BallotUnreadable(f"rank {rank}'s ballot is unreadable ({e}): {bytes(raw[:80])!r}") from None
    except msgspec.DecodeError as e:
        raise BallotUnreadable(f"rank {rank}'s ballot is unreadable ({e}): {bytes(raw[:80])!r}") from None
    if b.digests and len(b.digests) != len(b.ids):
        raise BallotUnreadable(f"rank {rank}'s ballot has {len(b.digests)} digests for {len(b.ids)} ids")
    return b


def seq_digest(s, model_digest: str = "") -> str:
    """A rank's digest of what it would run for sequence ``s`` (a serving loop's ``_Seq``: its
    ``cmd`` as the control told it, ``tokens``, ``num_computed``) on the weights ``model_digest``."""
    cmd = s.cmd
    # the command's part (its block table: hundreds of ids at long contexts) is hashed once per
    # command and weights, not at every step of every sequence: kept on the sequence, redone when
    # its command is another object (a fault's replaced table) or the weights changed
    told = getattr(s, "_ballot_told", None)
    if told is None or told[0] is not cmd or told[1] != model_digest:
        text = "|".join((cmd.request_id, ",".join(map(str, cmd.block_ids)), f"{cmd.num_cached_tokens}",
                         ",".join(map(str, cmd.copy_from)), cmd.awaits_move, model_digest))
        told = (cmd, model_digest, hashlib.blake2b(text.encode(), digest_size=8).hexdigest())
        s._ballot_told = told
    last = s.tokens[-1] if s.tokens else -1
    text = f"{told[2]}|{s.num_computed}/{len(s.tokens)}/{last}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def agreed_order(posts: list[list[str]]) -> list[str]:
    """The ids every rank posted, in the first rank's order: a request runs only once every rank
    holds it (the MIN over ranks), never because one rank's local view had it."""
    if not posts:
        return []
    others = [set(p) for p in posts[1:]]
    return [i for i in posts[0] if all(i in o for o in others)]


@dataclass(frozen=True)
class Verdict:
    """One round's verdict, the same on every rank. ``split``: the first agreed id whose digests
    differ (None: they agree, the step runs ``agreed``); ``digests``: each rank's digest of it."""

    agreed: list[str]
    split: str | None = None
    digests: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return self.split is None


UNREADABLE = "unreadable"


def judge(ballots: list[StepBallot]) -> Verdict:
    """The verdict of one round over every rank's ballot (by rank). An id is compared only among
    the ranks that said a digest for it (an ids-only post says none)."""
    agreed = agreed_order([b.ids for b in ballots])
    said = [dict(zip(b.ids, b.digests)) if b.digests else {} for b in ballots]
    for rid in agreed:
        known = {d[rid] for d in said if rid in d}
        if len(known) > 1:
            return Verdict(agreed=agreed, split=rid, digests=[d.get(rid, "") for d in said])
    return Verdict(agreed=agreed)


def judge_posts(raws: list[bytes]) -> Verdict:
    """The verdict of one round over every rank's post as the store holds it. A post that cannot
    be read is a split too (every rank reads the same bytes, so every rank refuses): no request
    is named, and that rank's digest is ``unreadable``."""
    ballots, bad = [], []
    for rank, raw in enumerate(raws):
        try:
            ballots.append(decode_ballot(raw, rank))
        except BallotUnreadable:
            bad.append(rank)
    if bad:
        return Verdict(agreed=[], split="", digests=[UNREADABLE if r in bad else "" for r in range(len(raws))])
    return judge(ballots)


__all__ = ["BallotUnreadable", "UNREADABLE", "Verdict", "agreed_order", "decode_ballot", "encode_ballot", "judge",
           "judge_posts", "seq_digest"]
