"""How the serving side asks the control process for moves and releases.

The serving side never moves a page itself: it asks through ``proc.submit`` like any operator
would, so each move is written ahead, funded by the budget and recorded. The answer comes back
on the loop thread, where ``then(answer)`` runs.
"""
from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Callable

import structlog

from residency.control.scheduler.port import BackendError
from residency.events import catalog as ev
from residency.events.asks import AskAnswered, AskReleaseBlocks

log = structlog.get_logger("control.serving")
# The events a move can end with, as its answer or the ledger carries them (a stranded move may
# still be acked late).
TERMINAL = (ev.MoveAcked, ev.MoveFailed, ev.MoveRejected, ev.MoveStranded, ev.MoveAbandoned, ev.MoveLateAcked)


class Asker:
    def __init__(self, proc):
        self.proc = proc
        self._ids = itertools.count(1)

    def ask(self, msg, asker: str, then: Callable[[AskAnswered], None]) -> None:
        """Submit ``msg`` (an ``AskMove`` or ``AskReleaseBlocks``) as ``asker`` ("serving" for
        what a request needs, "operator" for the admin routes); ``then`` gets the answer."""
        fut: Future = self.proc.submit(msg, asker)
        fut.add_done_callback(lambda f: self._answered(f, then))

    def new_id(self, what: str) -> str:
        return f"serving-{what}-{next(self._ids)}"

    def release(self, worker: int, by_tier: dict[str, list[int]], reason: str, session: str | None = None) -> None:
        """Free pages a request no longer needs (``session``'s, if it names one), tier by tier; a
        failure is only logged, since the request goes on without them."""
        for tier, blocks in by_tier.items():
            if blocks:
                self.ask(AskReleaseBlocks(ask_id=self.new_id("release"), worker=worker, tier=tier, blocks=blocks,
                                          reason=reason, session=session), "serving",
                         lambda ans, t=tier: ans.error and log.warning("release_failed", tier=t, error=ans.error,
                                                                       detail=ans.detail))

    def _answered(self, fut: Future, then) -> None:
        try:
            ans = fut.result()
        except Exception as e:  # noqa: BLE001
            ans = AskAnswered(ask_id="", error="ask_failed", detail=repr(e))
        try:
            then(ans)
        except Exception:  # noqa: BLE001 - one request's bug must not stop the control loop
            log.exception("serving_callback_failed")


def answer_error(ans: AskAnswered) -> BackendError:
    """The API's error for an answer that refused or rejected the move."""
    refused = next((e for e in ans.events if type(e) is ev.MoveRefused), None)
    if refused is not None:
        return BackendError(503, f"refused: {refused.reason}", type="server_error", code="move_refused")
    return BackendError(409 if ans.error == "invalid_ask" else 503, f"{ans.error}: {ans.detail}",
                        type="invalid_request_error" if ans.error == "invalid_ask" else "server_error",
                        code=ans.error)
