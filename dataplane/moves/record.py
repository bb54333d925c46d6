"""The outcomes of one worker's settled moves, by move_id: what a duplicate command, a control
that restarted (``QueryMoves``) and the mover's integrity check are answered from."""
from __future__ import annotations

from collections.abc import Container, Iterable

from residency.dataplane.pools import IntegrityError
from residency.events.catalog import MoveAcked, MoveFailed, MoveRejected
from residency.events.commands import MovesReport

Outcome = MoveAcked | MoveFailed | MoveRejected


class MoveRecord:
    def __init__(self, worker: int, log):
        self.worker = worker
        self.log = log
        self._outcomes: dict[str, Outcome] = {}

    def __contains__(self, move_id: str) -> bool:
        return move_id in self._outcomes

    def get(self, move_id: str) -> Outcome | None:
        """The recorded outcome, or None if none is."""
        return self._outcomes.get(move_id)

    def add(self, outcome: Outcome) -> Outcome:
        self._outcomes[outcome.move_id] = outcome
        # NOTE: the ledger records every outcome; the mover logs an ack at debug level only
        # (a rendered log line costs ~0.1 ms, a few percent of a 2 GiB move's budget) and a
        # refusal or failure at info, with its reason.
        if isinstance(outcome, MoveAcked):
            self.log.debug("move_acked", move_id=outcome.move_id, bytes_moved=outcome.bytes_moved,
                           bytes_freed_src=outcome.bytes_freed_src,
                           duration_ms=(outcome.finished_ns - outcome.started_ns) / 1e6)
        else:
            self.log.info("move_" + type(outcome).__name__.removeprefix("Move").lower(), move_id=outcome.move_id,
                          reason=getattr(outcome, "reason", None) or getattr(outcome, "error", None))
        return outcome

    def report(self, move_ids: Iterable[str], in_flight: Container[str]) -> MovesReport:
        """Answer a QueryMoves: the recorded outcomes, and the ids neither recorded nor in flight."""
        ids = list(move_ids)
        return MovesReport(worker=self.worker, outcomes=[self._outcomes[m] for m in ids if m in self._outcomes],
                           unknown=[m for m in ids if m not in self._outcomes and m not in in_flight])

    def check_integrity(self, in_flight: Iterable[str]) -> None:
        both = set(self._outcomes) & set(in_flight)
        if both:
            raise IntegrityError(f"moves both in flight and settled: {sorted(both)[:8]}")
        wrong = [m for m, o in self._outcomes.items() if o.move_id != m]
        if wrong:
            raise IntegrityError(f"outcomes recorded under another move_id: {wrong[:8]}")
