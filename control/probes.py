"""Hooks for tests and benchmarks, off unless named: injected crashes and move traces."""
from __future__ import annotations

import collections
import os
import signal
import time

import structlog

log = structlog.get_logger("control.probes")


class ControlFaults:
    """Fault hooks for the fault tests, OFF unless named (``faults`` or RESIDENCY_CONTROL_FAULTS):

        crash_after_requested=N    SIGKILL self when the Nth command is about to be sent
                                   (its MoveRequested is committed; the worker never sees it)
        crash_after_dispatch=N     SIGKILL self 50 ms after sending the Nth command (before its ack)
        crash_before_ack_append=N  SIGKILL self on receiving the Nth move outcome, before recording it
        crash_after_events=N       SIGKILL self right after handing the Nth event to the writer
    """

    NAMES = ("crash_after_requested", "crash_after_dispatch", "crash_before_ack_append", "crash_after_events")

    def __init__(self, spec: str = ""):
        self.at: dict[str, int] = {}
        self.count: dict[str, int] = collections.Counter()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name not in self.NAMES:
                raise ValueError(f"unknown control fault {name!r} (known: {', '.join(self.NAMES)})")
            self.at[name] = int(value)

    def hit(self, name: str, delay_s: float = 0.0) -> None:
        if name not in self.at:
            return
        self.count[name] += 1
        if self.count[name] == self.at[name]:
            log.warning("fault_injected_crash", fault=name, n=self.at[name])
            if delay_s:
                time.sleep(delay_s)
            os.kill(os.getpid(), signal.SIGKILL)


class MoveTraces:
    """Wall-clock marks (``time.time_ns``, the clock of a worker's ``started_ns``/``finished_ns``)
    of the phases of the last ``keep`` moves: where a move's time goes between the asker and the
    worker (bench/control.py prints the breakdown). Off (keep=0) unless configured.

        asked      the loop took the ask          requested  its MoveRequested folded and buffered
        ahead      its CommandAhead handed to ZMQ (a big copy's; before ``requested``)
        committed  that event committed (sent)    sent       the command handed to ZMQ
        received   the outcome read off the socket (before decoding)
        decoded    the outcome decoded, handler entered
        recorded   its terminal event folded and buffered
        nearly_done    its MoveNearlyDone came;  warmed  the ledger writer warmed for its ack
        ack_committed  (an ack committed at once) its commit returned
        answered   that event committed, the asker answered
    """

    def __init__(self, keep: int = 0):
        self.keep = keep
        self.by_move: dict[str, dict[str, int]] = {}

    def mark(self, move_id: str, phase: str, t_ns: int | None = None) -> None:
        if not self.keep:
            return
        marks = self.by_move.get(move_id)
        if marks is None:
            if len(self.by_move) >= self.keep:
                del self.by_move[next(iter(self.by_move))]
            marks = self.by_move[move_id] = {}
        marks[phase] = time.time_ns() if t_ns is None else t_ns
