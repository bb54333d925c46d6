"""Hand-built ledgers for the detector tests: a clock, gapless seqs, fresh random ids and sizes.

Every builder draws its ids and sizes from its own ``random.Random(seed)``; the tests get a fresh
seed each run (printed, so a failure can be replayed with ``RESIDENCY_TEST_SEED``).
"""
from __future__ import annotations

import os
import random

from residency.events import Envelope, Recorded
from residency.events import catalog as ev

SECOND = 1_000_000_000
MS = 1_000_000
T0 = 1_790_000_000 * SECOND


def fresh_seed() -> int:
    seed = int(os.environ.get("RESIDENCY_TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"ledger seed {seed}")
    return seed


class Ledger:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = T0 + self.rng.randrange(10**12)
        self.events: list[Recorded] = []
        self.block_bytes: dict[int, int] = {}
        self._next_block = self.rng.randrange(1000, 10**6)

    # ------------------------------------------------------------ basics
    @property
    def seq(self) -> int:
        return len(self.events)

    def add(self, event: ev.Event, *, dt_ms: float = 1.0, correlation: str | None = None,
            causation: str | None = None) -> Recorded:
        self.now += int(dt_ms * MS)
        seq = len(self.events) + 1
        env = Envelope(producer="test", epoch=1, producer_seq=seq, ts_ns=self.now,
                       correlation_id=correlation, causation=causation, seq=seq)
        rec = Recorded(env, event)
        self.events.append(rec)
        return rec

    def wait(self, seconds: float) -> None:
        self.now += int(seconds * SECOND)

    def uid(self, prefix: str) -> str:
        return f"{prefix}-{self.rng.getrandbits(40):010x}"

    def blocks(self, n: int) -> list[int]:
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n + self.rng.randrange(1, 50)
        return out

    # ------------------------------------------------------------ vocabulary
    def worker(self, w: int, device_blocks: int = 64, host_blocks: int = 256) -> int:
        bb = self.rng.choice([1, 2, 4]) * (1 << 20) + self.rng.randrange(0, 4) * 4096
        self.block_bytes[w] = bb
        self.add(ev.WorkerJoined(worker=w, device=f"cuda:{w}", block_bytes=bb,
                                 tiers={"device": device_blocks * bb, "host": host_blocks * bb, "disk": 4096 * bb}))
        return bb

    def commit(self, w: int, n: int, tier: str = "device", session: str | None = None, dt_ms: float = 1.0) -> list[int]:
        blocks = self.blocks(n)
        self.add(ev.BlocksCommitted(worker=w, session=session, tier=tier, blocks=blocks,
                                    keys=[f"{self.rng.getrandbits(64):016x}" for _ in blocks],
                                    bytes=n * self.block_bytes[w]), dt_ms=dt_ms)
        return blocks

    def free(self, w: int, blocks: list[int], tier: str = "device", dt_ms: float = 1.0) -> Recorded:
        return self.add(ev.BlocksFreed(worker=w, tier=tier, blocks=blocks, bytes=len(blocks) * self.block_bytes[w],
                                       reason="finished"), dt_ms=dt_ms)

    def request_move(self, w: int, kind: str, src: str, dst: str, blocks: list[int], *, deadline_ms: float = 50,
                     session: str | None = None, keep: bool = False, dt_ms: float = 1.0,
                     causation: str | None = None, reason: str = "pressure") -> tuple[str, Recorded]:
        mid = self.uid("m")
        rec = self.add(ev.MoveRequested(move_id=mid, kind=kind, worker=w, src=src, dst=dst, blocks=blocks,
                                        bytes_planned=len(blocks) * self.block_bytes[w], keep_source=keep,
                                        deadline_ns=self.now + int(dt_ms * MS) + int(deadline_ms * MS),
                                        reason=reason, session=session),
                       dt_ms=dt_ms, correlation=session, causation=causation)
        return mid, rec

    def ack(self, mid: str, w: int, nbytes: int, dt_ms: float = 1.0, freed: int | None = None) -> Recorded:
        return self.add(ev.MoveAcked(move_id=mid, worker=w, bytes_moved=nbytes,
                                     bytes_freed_src=nbytes if freed is None else freed, checksum_ok=True,
                                     started_ns=self.now, finished_ns=self.now + int(dt_ms * MS)),
                        dt_ms=dt_ms, causation=mid)

    def move(self, w: int, kind: str, src: str, dst: str, blocks: list[int], *, session: str | None = None,
             keep: bool = False, dt_ms: float = 1.0) -> str:
        mid, _ = self.request_move(w, kind, src, dst, blocks, session=session, keep=keep, dt_ms=dt_ms)
        self.ack(mid, w, len(blocks) * self.block_bytes[w], freed=0 if keep else None)
        return mid

    def admit(self, session: str | None = None, dt_ms: float = 1.0) -> tuple[str, Recorded]:
        rid = self.uid("req")
        rec = self.add(ev.RequestAdmitted(request_id=rid, session=session, prompt_tokens=self.rng.randrange(1, 4000)),
                       dt_ms=dt_ms, correlation=rid)
        return rid, rec

    def finish(self, rid: str, dt_ms: float = 1.0) -> Recorded:
        return self.add(ev.RequestFinished(request_id=rid, reason="stop", completion_tokens=self.rng.randrange(1, 500)),
                        dt_ms=dt_ms, correlation=rid)

    def step(self, w: int, step: int, digest: str | None = None, dt_ms: float = 1.0, num_seqs: int | None = None) -> Recorded:
        return self.add(ev.StepCompleted(worker=w, step=step, batch_digest=digest or f"{self.rng.getrandbits(64):016x}",
                                         num_seqs=num_seqs if num_seqs is not None else self.rng.randrange(1, 64),
                                         num_tokens=self.rng.randrange(1, 4096),
                                         duration_ns=self.rng.randrange(1, 40) * MS), dt_ms=dt_ms)

    def chatter(self, seconds: float, every_ms: float = 200.0) -> None:
        """Events that are not progress (alive processes talking) for ``seconds``."""
        t_end = self.now + int(seconds * SECOND)
        while self.now + int(every_ms * MS) <= t_end:
            self.add(ev.StateCheckpoint(through_seq=self.seq, state_hash=f"{self.rng.getrandbits(128):032x}"),
                     dt_ms=every_ms)
        self.now = t_end


_SIMULATED: dict[tuple[int, int], list[Recorded]] = {}


def simulated(n: int, seed: int) -> list[Recorded]:
    """A simulated ledger as Recorded rows, built once per process (the simulator folds as it goes)."""
    from residency.control.simulate import simulate  # noqa: PLC0415

    key = (n, seed)
    if key not in _SIMULATED:
        _SIMULATED[key] = [Recorded(env, e) for env, e in simulate(n, seed=seed)]
    return _SIMULATED[key]
