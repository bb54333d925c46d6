"""Restores a returning turn's prefill may start on before they are finished (device thread only).

The control sends a returning turn's ``Generate`` as soon as the restore of its history is
dispatched, naming the move (``Generate.awaits_move``); the commands reach the device thread in
that order. A serving worker's mover lands restores from the host or from disk layer by layer
(dataplane/moves/layered.py, layered_disk.py), and this keeps such a move's finish (wait, verify, commit, ack)
for later, so the Generate that follows can join its layers:

    ExecuteMove(restore)  ─► submitted, kept here           (no outcome yet: the record says running)
    Generate(awaits_move) ─► its prefill reads layer l once layer l is in (``landing``)
    after that step       ─► ``settle``: the move verified and committed, or failed; its outcome
                             leaves first, then the step's tokens; a sequence whose restore failed
                             is failed (its error to the client), none of its tokens sent

A kept move is also settled as soon as its copies are done (``poll``, every turn of the device
thread), and before any command other than a Generate or a cancel runs (``settle_all``), so every
other command finds the worker as it would have without this: restore finished.

NOTE: the prefill reads pages whose checksums are not yet compared. Nothing computed from them
leaves the worker before the move's outcome is known: the serving loop settles the move after
the step that read them and before it samples (dataplane/serving.py).
"""
from __future__ import annotations

from collections.abc import Callable

import structlog

from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, ExecuteMove, Generate

log = structlog.get_logger("dataplane.restore_pipeline")
# the commands a kept restore's finish waits past; any other is run after it is settled
PASSES = (Generate, CancelGenerate)
# the routes a serving worker's mover lands layer by layer (Mover.LAYERED): from the host, from disk
KEPT_ROUTES = (("host", "device"), ("disk", "device"))


class KeptRestores:
    def __init__(self, mover):
        self.mover = mover
        self.kept: dict[str, ExecuteMove] = {}
        # settled, to send in order: (the command, its outcome, what the serving loop answers to it)
        self.ready: list[tuple[ExecuteMove, object, list]] = []
        # the serving loop's: (move_id, outcome) -> replies (its sequences that read the pages)
        self.listener: Callable[[str, object], list] | None = None

    def can_keep(self, cmd: ExecuteMove) -> bool:
        return getattr(self.mover, "layered_restores", False) and (cmd.src, cmd.dst) in KEPT_ROUTES

    def keep(self, cmd: ExecuteMove, begun: bool) -> None:
        """Submit ``cmd`` (or take it over, ``begun`` on its CommandAhead) and keep its finish."""
        if begun:
            self.mover.keep_own(cmd.move_id)
        else:
            self.mover.submit_own(cmd)
        self.kept[cmd.move_id] = cmd      # refused or failed at once: settled by the next ``poll``

    def holds(self, move_id: str) -> bool:
        return move_id in self.kept

    def landing(self, move_id: str):
        """(per layer, the wait for it; block -> its landing slot) of a kept move still in flight;
        None: not kept (settled, unknown here) or not landing by layer."""
        if move_id not in self.kept:
            return None
        return self.mover.landing(move_id)

    def settle(self, move_id: str):
        """Finish a kept move (waiting for its copies), queue its outcome to send; the outcome.
        A move no longer kept: its recorded outcome (None if unknown)."""
        cmd = self.kept.pop(move_id, None)
        if cmd is None:
            return self.mover.outcome_of(move_id)
        try:
            outcome = self.mover.wait(move_id)
        except Exception as e:  # noqa: BLE001 - answered as a failure, never left unanswered
            log.error("kept_restore_raised", move_id=move_id, error=repr(e))
            outcome = ev.MoveFailed(move_id=move_id, worker=self.mover.worker, error=f"{type(e).__name__}: {e}",
                                    bytes_moved=None)
        replies = self.listener(move_id, outcome) if self.listener is not None else []
        self.ready.append((cmd, outcome, replies))
        return outcome

    def poll(self) -> None:
        """Settle the kept moves whose copies are done (or that already have an outcome)."""
        for mid in [m for m in self.kept if self.mover.device_done(m) or self.mover.outcome_of(m) is not None]:
            self.settle(mid)

    def settle_all(self) -> None:
        for mid in list(self.kept):
            self.settle(mid)

    def take(self) -> list[tuple[ExecuteMove, object, list]]:
        out, self.ready = self.ready, []
        return out


def settled_ok(outcome) -> bool:
    return type(outcome) is ev.MoveAcked and outcome.checksum_ok


def why_not(outcome) -> str:
    """A failed restore's reason, as the request's error says it."""
    if outcome is None:
        return "its outcome is unknown to this worker"
    return getattr(outcome, "error", None) or getattr(outcome, "reason", None) or type(outcome).__name__


__all__ = ["KeptRestores", "PASSES", "settled_ok", "why_not"]
