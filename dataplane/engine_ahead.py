"""Early start: a move begun before its command comes (``Engine``'s mixin; engine thread only).

A worker's lane may hear a move's command ahead of time, riding on a ``CommandAhead`` sent while
the control's ``MoveRequested`` commits (events/commands.py). ``begin_ahead`` then begins the
move as ``submit`` would, except that nothing of it is recorded: until ``wait`` finishes it (the
command came), it is reserved destination slots and bytes in flight that nobody else can see, and
``abandon`` (the command did not come, or another came first) undoes it exactly.
"""
from __future__ import annotations

import time
from collections import deque
from itertools import repeat

from dataplane.moves import EXECUTORS, InFlight, validate
from events.catalog import MoveRejected
from events.commands import ExecuteMove

# Routes a move may begin before its command comes: their copies only fill slots they reserve;
# the disk routes write files, so they wait for their command.
AHEAD_ROUTES = {("device", "host"), ("host", "device")}


class EarlyStart:
    """``Engine.begin_ahead`` / ``Engine.abandon``; the fields are the Engine's."""

    def begin_ahead(self, cmd: ExecuteMove) -> bool:
        """Begin a device <-> host move whose command has not come yet (an early start: its
        CommandAhead came first). Validated as ``submit`` validates, but a refusal, or a failure
        to begin, is not recorded: it returns False, and the command, when it comes, runs and is
        answered as any. Until ``wait`` finishes it, the move is only reserved slots and bytes in
        flight that nothing else can see; ``abandon`` undoes it exactly. True: begun."""
        if cmd.move_id in self._outcomes or cmd.move_id in self._inflight or (cmd.src, cmd.dst) not in AHEAD_ROUTES:
            return False
        tiers = {t: self.pool(t) for t in ("device", "host", "disk")}
        plan = validate(cmd, tiers, self._busy, self.layout.block_bytes, self.worker, self.clock())
        if isinstance(plan, MoveRejected):
            return False
        mv = EXECUTORS[plan.route](self.ctx, plan, self.clock())
        mv.phases["submitted"] = time.perf_counter_ns()
        try:
            mv.begin()
        except Exception as e:  # noqa: BLE001 - the command runs as any when it comes
            self._undo(mv, "begin_ahead_failed", repr(e))
            return False
        mv.mark("enqueued")
        self._busy.update(dict.fromkeys(plan.blocks, cmd.move_id))
        self._inflight[cmd.move_id] = mv
        return True

    def abandon(self, move_id: str, why: str) -> None:
        """Undo an early-started move whose command did not come (``begin_ahead``): wait for what
        it enqueued, drop its reservations (the pools exactly as before), record nothing."""
        mv = self._inflight.pop(move_id, None)
        if mv is None:
            return
        deque(map(self._busy.pop, mv.ids, repeat(None, len(mv.ids))), maxlen=0)
        self._undo(mv, "move_abandoned", why, self.log.warning)

    def _undo(self, mv: InFlight, what: str, why: str, say=None) -> None:
        try:
            mv.abort()
        except Exception as e:  # noqa: BLE001
            self.log.error("move_abort_failed", move_id=mv.cmd.move_id, error=repr(e))
        (say or self.log.info)(what, move_id=mv.cmd.move_id, why=why)
