"""Fault hooks for the fault tests, off unless named (``--faults`` or RESIDENCY_WORKER_FAULTS).

They act on the one path the product runs: a move's outcome, sent early or late, from either
socket, leaves through an ``Outbox`` (dataplane/outbox.py), which holds, drops, repeats or
reorders it; the device thread calls ``move_executed`` once per move it ran, right before that
move's outcome is handed to an outbox.
"""
from __future__ import annotations

import os
import random
import signal
import time

import structlog

log = structlog.get_logger("dataplane.faults")


def rank_faults(spec: str, rank: int) -> str:
    """The parts of ``spec`` (separated by ';') for rank ``rank``: those naming ``on_rank=rank``
    and those naming no rank, e.g. ``on_rank=1,drop_ack=1;on_rank=2,diverge_table=3``."""
    kept = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        names = dict(x.strip().partition("=")[::2] for x in part.split(",") if x.strip())
        if "on_rank" not in names or int(names["on_rank"]) == rank:
            kept.append(part)
    return ",".join(kept)


class WorkerFaults:
    """The hooks, parsed from a spec such as ``drop_ack=0.1,seed=3``:

        drop_ack=P           a move's outcome is never sent (the watchdog strands it; a re-query
                             brings it back as a late ack)
        delay_ack=P:MS       an outcome is held MS ms before it is sent
        duplicate_ack=P      an outcome is sent twice
        reorder_ack=P        an outcome is held back and sent after the next one
        silent_release=P     a release is carried out and never answered
        zero_release=P       a release is answered with bytes_freed=0
        crash_after_moves=N  SIGKILL self right after executing the Nth move, before its ack
        exec_delay_ms=MS     every move pauses MS ms half-way (after the mover's submit, before its
                             wait), so a test can kill the worker in the middle of a move
        stall_step=N:MS      the device thread freezes MS ms before its Nth serving step, while
                             the I/O thread goes on answering pings (a wedged engine)
        miss_stamp=READER    on the next rebind of the device pool, that reader does not stamp
                             (the pool is torn); one-shot: the rebind after it stamps as usual
        diverge_table=N      a rank of a group changes one page id of the block table of the Nth
                             sequence it is told to run, before that sequence's first step (its
                             tables digest then differs from its peers'; dataplane/group.py)
        diverge_ballot=N     a rank of a group posts another digest for the Nth sequence it is
                             told to run, in every ballot naming it: the ranks' ballots split
                             before that sequence's first step, and no rank runs it
        fail_seq=N           a rank of a group fails the Nth sequence it is told to run, alone,
                             before that sequence's first step (as a restore of its shard that
                             failed its checksum would): the control cancels it on the peers
        refuse_swap=N        the Nth SwapWeights this worker is sent is refused before anything
                             moves (with on_rank=R: one rank of a group refuses while its peers
                             swap, so the group's flip is torn)
        stall_swap=N:MS      the device thread freezes MS ms before it runs the Nth SwapWeights
                             (a rank a test can kill in the middle of a group's flip)
        on_rank=R            the faults of this part act only on rank R of a group: serve passes
                             one spec to every worker, parts separated by ';' (``rank_faults``)
        seed=S               the random source of the probabilities above
    """

    PROBABILITIES = ("drop_ack", "duplicate_ack", "reorder_ack", "silent_release", "zero_release")

    def __init__(self, spec: str = ""):
        self.p: dict[str, float] = {}
        self.delay_p, self.delay_ms = 0.0, 0.0
        self.crash_after_moves = 0
        self.exec_delay_ms = 0.0
        self.stall_step, self.stall_ms = 0, 0.0
        self.miss_stamp: str | None = None
        self.diverge_table = 0
        self.diverge_ballot = 0
        self.fail_seq = 0
        self.refuse_swap = 0
        self.stall_swap, self.stall_swap_ms = 0, 0.0
        self.num_swaps = 0
        self.on_rank: int | None = None
        seed = 0
        for part in filter(None, (x.strip() for x in spec.split(","))):
            name, _, value = part.partition("=")
            if name in self.PROBABILITIES:
                self.p[name] = float(value)
            elif name == "delay_ack":
                p, _, ms = value.partition(":")
                self.delay_p, self.delay_ms = float(p), float(ms or 100)
            elif name == "crash_after_moves":
                self.crash_after_moves = int(value)
            elif name == "exec_delay_ms":
                self.exec_delay_ms = float(value)
            elif name == "stall_step":
                n, _, ms = value.partition(":")
                self.stall_step, self.stall_ms = int(n), float(ms or 10_000)
            elif name == "miss_stamp":
                if not value:
                    raise ValueError("miss_stamp needs a reader's name (mover, staging, serving, graphs)")
                self.miss_stamp = value
            elif name == "diverge_table":
                self.diverge_table = int(value)
            elif name == "diverge_ballot":
                self.diverge_ballot = int(value)
            elif name == "fail_seq":
                self.fail_seq = int(value)
            elif name == "stall_swap":
                n, _, ms = value.partition(":")
                self.stall_swap, self.stall_swap_ms = int(n), float(ms or 10_000)
            elif name == "refuse_swap":
                self.refuse_swap = int(value)
            elif name == "on_rank":
                self.on_rank = int(value)
            elif name == "seed":
                seed = int(value)
            else:
                raise ValueError(f"unknown worker fault {name!r}; see dataplane.faults.WorkerFaults")
        self.rng = random.Random(seed)
        self.enabled = bool(self.p or self.delay_p or self.crash_after_moves or self.exec_delay_ms or self.stall_step
                            or self.miss_stamp or self.diverge_table or self.diverge_ballot or self.fail_seq
                            or self.refuse_swap
                            or self.stall_swap)
        self.counts: dict[str, int] = {}
        self.num_moves = 0
        self.num_steps = 0

    def roll(self, name: str) -> bool:
        p = self.p.get(name, 0.0)
        hit = p > 0 and self.rng.random() < p
        if hit:
            self.counts[name] = self.counts.get(name, 0) + 1
        return hit

    def roll_delay_s(self) -> float:
        if self.delay_p > 0 and self.rng.random() < self.delay_p:
            self.counts["delay_ack"] = self.counts.get("delay_ack", 0) + 1
            return self.delay_ms / 1000
        return 0.0

    def move_executed(self, move_id: str) -> None:
        """A move ran and its outcome is about to leave: ``crash_after_moves`` kills the process
        here, so the control never hears of the Nth move (device thread only)."""
        self.num_moves += 1
        if self.crash_after_moves and self.num_moves == self.crash_after_moves:
            log.warning("fault_injected_crash", fault="crash_after_moves", n=self.num_moves, move_id=move_id)
            os.kill(os.getpid(), signal.SIGKILL)

    def take_miss_stamp(self) -> str | None:
        """The reader that must miss this rebind's stamp, once (device thread only)."""
        name, self.miss_stamp = self.miss_stamp, None
        if name is not None:
            self.counts["miss_stamp"] = self.counts.get("miss_stamp", 0) + 1
        return name

    def before_swap(self) -> bool:
        """A SwapWeights is about to run: ``stall_swap`` freezes the device thread here; True when
        ``refuse_swap`` refuses this one, the Nth this worker was sent (device thread only)."""
        self.num_swaps += 1
        if self.stall_swap and self.num_swaps == self.stall_swap:
            log.warning("fault_injected_stall", fault="stall_swap", n=self.num_swaps, ms=self.stall_swap_ms)
            self.counts["stall_swap"] = 1
            time.sleep(self.stall_swap_ms / 1000)
        hit = bool(self.refuse_swap) and self.num_swaps == self.refuse_swap
        if hit:
            self.counts["refuse_swap"] = 1
            log.warning("fault_injected_swap_refusal", fault="refuse_swap", n=self.num_swaps)
        return hit

    def before_step(self) -> None:
        """A serving step is about to run: ``stall_step`` freezes the device thread here (device
        thread only)."""
        self.num_steps += 1
        if self.stall_step and self.num_steps == self.stall_step:
            log.warning("fault_injected_stall", fault="stall_step", n=self.num_steps, ms=self.stall_ms)
            self.counts["stall_step"] = 1
            time.sleep(self.stall_ms / 1000)
