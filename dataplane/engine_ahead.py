"""Early start: a move begun before its command comes (``Engine``'s mixin; engine thread only).

A worker's lane may hear a move's command ahead of time, riding on a ``CommandAhead`` sent while
the control's ``MoveRequested`` commits (events/commands.py). ``begin_ahead`` then begins the
move as ``submit`` would, except that nothing of it is recorded: until ``wait`` finishes it (the
command came), it is reserved destination slots and bytes in flight that nobody else can see, and
``abandon`` (the command did not come, or another came first) undoes it exactly.
"""
from __future__ import annotations

from residency.events.commands import ExecuteMove

# Routes a move may begin before its command comes: their copies only fill slots they reserve;
# the disk routes write files, so they wait for their command.
AHEAD_ROUTES = {("device", "host"), ("host", "device")}


class EarlyStart:
    """``Engine.begin_ahead`` / ``Engine.abandon``; the fields and helpers (``_admit``,
    ``_unregister``, ``_undo``) are the Engine's."""

    def begin_ahead(self, cmd: ExecuteMove) -> bool:
        """Begin a device <-> host move whose command has not come yet (an early start: its
        CommandAhead came first). Admitted as ``submit`` admits it, but a refusal, or a failure
        to begin, is not recorded: it returns False, and the command, when it comes, runs and is
        answered as any. Until ``wait`` finishes it, the move is only reserved slots and bytes in
        flight that nothing else can see; ``abandon`` undoes it exactly. True: begun."""
        if (cmd.src, cmd.dst) not in AHEAD_ROUTES:
            return False
        mv = self._admit(cmd, record=False)
        if mv is None:
            return False
        try:
            mv.begin()
        except Exception as e:  # noqa: BLE001 - the command runs as any when it comes
            self._unregister(mv)
            self._undo(mv, "begin_ahead_failed", repr(e))
            return False
        mv.mark("enqueued")
        mv.ahead = True                 # not settled beside another move: only its own wait finishes it
        return True

    def abandon(self, move_id: str, why: str) -> None:
        """Undo an early-started move whose command did not come (``begin_ahead``): wait for what
        it enqueued, drop its reservations (the pools exactly as before), record nothing."""
        mv = self._inflight.get(move_id)
        if mv is None:
            return
        self._unregister(mv)
        self._undo(mv, "move_abandoned", why, self.log.warning)
