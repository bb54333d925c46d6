"""A flip, sleep or wake of a tensor-parallel group's weights: every rank's arena at once, one
verdict for all of them (pure; the loop's side is control/flipping.py).

Every rank holds its share of the same model in its own arena, so a group serves one model only
when every rank's arena holds it at once. The control writes one ``FlipRequested`` (and one
``RebindRequested``) per rank, with id ``<fid>.r<rank>`` (a worker alone keeps ``<fid>``), and
sends each rank its own ``SwapWeights``. One event per rank keeps the fold and ``flip.closed``
as they are: a rank's arena is a worker's arena, with its own bytes (its share), generation and
verdict; the group's unity lives in this verdict, as a group resize's does in ``dial.verdicts``.

The verdict waits for every rank's ``WeightsSwapped``, the deadline, or a rank's loss:

    every rank swapped, checked, every reader at to_gen  -> "completed": each rank's own
                                                            FlipCompleted (its measured bytes)
    every rank refused before moving a byte              -> "refused": each rank's FlipFailed and
                                                            RebindRefused; nothing changed
    anything else (some swapped, some refused, a rank    -> "torn": a rank that refused keeps its
    silent or lost, a checksum or a reader behind)          FlipFailed (not stranded); every other
                                                            rank's arena is stranded (FlipFailed
                                                            stranded, RebindTorn naming each peer's
                                                            shortfall), and the group is stopped

A torn group is never left serving with ranks that hold different models: a collective over
shards of two models would compute garbage on every rank, so the group serves nothing until
serve restarts (``GroupStopped`` names the flip and each rank's state).
"""
from __future__ import annotations

from residency.events import catalog as ev
from residency.events.commands import WeightsSwapped
from residency.control.flip import ROUTER, WORKER


def rank_flip_id(fid: str, rank: int, num_ranks: int) -> str:
    """The flip id of one rank's arena in a flip of ``num_ranks`` arenas (a worker alone: ``fid``)."""
    return fid if num_ranks == 1 else f"{fid}.r{rank}"


def answer_ok(req: ev.FlipRequested, ans: WeightsSwapped) -> bool:
    """The rank swapped, both images verified, and every reader it names is at ``to_gen``."""
    return (not ans.error and ans.checksum_ok and not ans.refused
            and all(g == req.to_gen for g in ans.stamps.values()))


def outcome(reqs: dict[int, ev.FlipRequested], answers: dict[int, WeightsSwapped | None]) -> str:
    """"completed", "refused" or "torn" for the ranks ``reqs`` names (a missing answer: silent)."""
    got = [answers.get(w) for w in reqs]
    if all(a is not None and answer_ok(reqs[w], a) for w, a in zip(reqs, got)):
        return "completed"
    if all(a is not None and a.error for a in got):
        return "refused"
    return "torn"


def shortfall(worker: int, req: ev.FlipRequested, ans: WeightsSwapped | None, silent_why: str = "") -> str:
    """One rank's state after a flip, in words (for the torn verdict and the group's stop)."""
    if ans is None:
        return f"worker {worker}: no answer" + (f" ({silent_why})" if silent_why else "")
    if ans.error:
        return f"worker {worker}: refused ({ans.error})"
    if not answer_ok(req, ans):
        return f"worker {worker}: swapped but not verified (checksum_ok={ans.checksum_ok}, refused={ans.refused})"
    held = ans.resident or "nothing (asleep)"
    return f"worker {worker}: {req.action} done, holds {held} at gen {ans.to_gen}"


def torn(reqs: dict[int, ev.FlipRequested], answers: dict[int, WeightsSwapped | None],
         at_stake: dict[int, int], silent_why: str = "") -> tuple[list[ev.Event], str]:
    """The events of a torn group flip (per rank, leader first) and the reason its group stops."""
    lines = {w: shortfall(w, reqs[w], answers.get(w), silent_why) for w in reqs}
    leader = next(iter(reqs))
    why = (f"{reqs[leader].action} {reqs[leader].flip_id.rpartition('.r')[0] or reqs[leader].flip_id} of the "
           "group torn, its ranks would not hold one model: " + "; ".join(lines.values()))
    out: list[ev.Event] = []
    for w, req in reqs.items():
        ans = answers.get(w)
        peers = [lines[p] for p in reqs if p != w]
        if ans is not None and ans.error:      # this rank changed nothing; its peers did, or may have
            out += [ev.FlipFailed(flip_id=req.flip_id, error=f"{ans.error}; {why}"),
                    ev.RebindRefused(rebind_id=req.flip_id, worker=w, error=ans.error)]
        else:
            out += [ev.FlipFailed(flip_id=req.flip_id, error=why, stranded=True, stranded_bytes=at_stake.get(w)),
                    ev.RebindTorn(rebind_id=req.flip_id, readers_behind=[ROUTER, WORKER] + peers)]
    return out, why


__all__ = ["rank_flip_id", "answer_ok", "outcome", "shortfall", "torn"]
