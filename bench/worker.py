"""The benches' worker process: the product worker (``python -m residency.dataplane.proc``, all
its options) with two instruments of the benches.

    python bench/worker.py [--nocopy] [--report-timings] [--cpu N] --worker N --control ipc://... --run-dir DIR ...

    --nocopy          a ``NoCopyMover`` instead of the tier mover: it keeps block tables and moves
                      no bytes (the control plane measured alone, bench/control.py --engines
                      nocopy; the worker's socket side tested without torch). Never for serving.
    --report-timings  after each move's (or release's) outcome on the lane, a ``MoveTimed`` with
                      where its time went in the worker; the control records it in its move
                      traces (``ControlConfig.trace_moves``) for bench/control_spill.py's breakdown.
    --cpu N           the whole worker process on CPU N (bench/placement.py places the control side)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from residency.dataplane.build import layout_block_bytes, parse_layout
from residency.dataplane.proc import main
from residency.dataplane.worker import WorkerCore
from residency.events import catalog as ev
from residency.events.commands import (
    BlocksReleased, BlocksWritten, CommitBlocks, ExecuteMove, MoveTimed, ReleaseBlocks,
)

Outcome = ev.MoveAcked | ev.MoveFailed | ev.MoveRejected


class NoCopyError(Exception):
    """The no-copy mover's "no" (it imports nothing of the real data plane, so not a DataPlaneError)."""


class _Blocks:
    def __init__(self, ids: set[int]):
        self._ids = ids

    def blocks(self) -> set[int]:
        return set(self._ids)


class NoCopyMover:
    """Keeps the block tables and answers like the tier mover, moving no bytes at all.

    It validates like the mover (blocks on src, none on dst, room) so acks stay truthful about
    placement; ``bytes_moved`` is what a copy would have moved.
    """

    def __init__(self, block_bytes: int, capacities: dict[str, int], worker: int = 0, device: str = "cpu"):
        self.block_bytes = block_bytes
        self.caps = dict(capacities)
        self.worker = worker
        self.device = device
        self.where: dict[str, set[int]] = {t: set() for t in capacities}
        self._outcomes: dict[str, Outcome] = {}

    def capacities(self) -> dict[str, int]:
        return dict(self.caps)

    def usage(self) -> dict[str, int]:
        return {t: len(b) * self.block_bytes for t, b in self.where.items()}

    def pool(self, tier: str) -> _Blocks:
        return _Blocks(self.where[tier])

    def _room(self, tier: str, n: int) -> int:
        return self.caps[tier] // self.block_bytes - len(self.where[tier]) - n

    def execute(self, cmd: ExecuteMove) -> Outcome:
        if cmd.move_id in self._outcomes:
            return self._outcomes[cmd.move_id]
        src, dst, ids = self.where[cmd.src], self.where[cmd.dst], cmd.blocks
        nbytes = len(ids) * self.block_bytes
        bad = [b for b in ids if b not in src or b in dst]
        if bad or self._room(cmd.dst, len(ids)) < 0:
            out = ev.MoveRejected(move_id=cmd.move_id, worker=self.worker, asked_bytes=nbytes, blocks=bad,
                                  reason="blocks not on src or already on dst" if bad else "no room",
                                  available_bytes=max(0, self._room(cmd.dst, 0)) * self.block_bytes)
        else:
            t0 = time.time_ns()
            dst.update(ids)
            if not cmd.keep_source:
                src.difference_update(ids)
            out = ev.MoveAcked(move_id=cmd.move_id, worker=self.worker, bytes_moved=nbytes,
                               bytes_freed_src=0 if cmd.keep_source else nbytes, checksum_ok=True,
                               started_ns=t0, finished_ns=time.time_ns())
        self._outcomes[cmd.move_id] = out
        return out

    def commit_blocks(self, cmd: CommitBlocks) -> BlocksWritten:
        tier = self.where[cmd.tier]
        if any(b in tier for b in cmd.blocks) or self._room(cmd.tier, len(cmd.blocks)) < 0:
            raise NoCopyError(f"cannot commit {len(cmd.blocks)} blocks on {cmd.tier}")
        tier.update(cmd.blocks)
        return BlocksWritten(request_id=cmd.request_id, worker=self.worker, tier=cmd.tier, blocks=list(cmd.blocks),
                             bytes=len(cmd.blocks) * self.block_bytes, keys=[""] * len(cmd.blocks))

    def release(self, cmd: ReleaseBlocks) -> BlocksReleased:
        tier = self.where[cmd.tier]
        missing = [b for b in cmd.blocks if b not in tier]
        if missing:
            raise NoCopyError(f"not resident on {cmd.tier}: blocks {missing[:16]}")
        tier.difference_update(cmd.blocks)
        return BlocksReleased(release_id=cmd.release_id, worker=self.worker, tier=cmd.tier, blocks=list(cmd.blocks),
                              bytes_freed=len(cmd.blocks) * self.block_bytes)

    def check_integrity(self) -> None:
        for t, b in self.where.items():
            if len(b) * self.block_bytes > self.caps[t]:
                raise NoCopyError(f"{t}: {len(b)} blocks exceed capacity {self.caps[t]}")

    def close(self) -> None:
        pass


def build_nocopy_core(args, faults) -> tuple[WorkerCore, int]:
    """``dataplane.proc.main``'s ``build``: a core around a ``NoCopyMover`` of ``--kv-layout``."""
    block_bytes = layout_block_bytes(parse_layout(args.kv_layout))
    caps = {"device": (args.device_blocks or 1024) * block_bytes, "host": args.host_bytes, "disk": args.disk_bytes}
    mover = NoCopyMover(block_bytes, caps, args.worker, args.device)
    return WorkerCore(mover, args.worker, faults, expected_errors=(NoCopyError,)), block_bytes


def report_timings(worker: int):
    """``dataplane.proc.main``'s ``after_move``: a MoveTimed after each outcome."""
    def after_move(cmd, marks: dict[str, int]) -> list:
        ref = getattr(cmd, "move_id", None) or cmd.release_id
        return [MoveTimed(move_id=ref, worker=worker, **marks)]
    return after_move


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--nocopy", action="store_true")
    p.add_argument("--report-timings", action="store_true")
    p.add_argument("--cpu", type=int, default=None)
    p.add_argument("--worker", type=int, default=0)
    mine, _ = p.parse_known_args(argv)
    rest = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--nocopy", "--report-timings")]
    if mine.cpu is not None:
        # Placed before any thread starts, so every thread of the worker (the device thread, the I/O
        # thread, ZMQ's I/O thread) inherits the one CPU.
        i = rest.index("--cpu")
        del rest[i:i + 2]
        os.sched_setaffinity(0, {mine.cpu})
    kw = {"build": build_nocopy_core} if mine.nocopy else {}
    if mine.report_timings:
        kw["after_move"] = report_timings(mine.worker)
    return main(rest, **kw)


if __name__ == "__main__":
    sys.exit(run())
