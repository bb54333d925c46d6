"""A realistic, valid ledger without real workers: for tests, benchmarks and demos.

The simulator keeps its own folded State and only emits events the fold accepts (every move
gets exactly one terminal outcome, copies exist where a move says, used <= capacity), so a
simulated ledger replays with ``check_integrity()`` clean. It writes the whole vocabulary:
spills, evictions, parks, restores, demotes/promotes, refusals with their arithmetic, stranded
moves (some later late-acked), a lost worker, rebinds (one torn), flips, requests and steps,
and a ``StateCheckpoint`` every ``checkpoint_every`` events.

Seqs are assumed to start at 1 (an empty ledger): the checkpoints name them.
"""
from __future__ import annotations

import random
from typing import Iterator

from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded
from residency.control.fold import fold
from residency.control.state import State, state_hash

GiB = 1 << 30
MiB = 1 << 20
T0_NS = 1_780_000_000_000_000_000          # a fixed origin, so a seed always writes the same ledger


class Simulator:
    def __init__(self, seed: int = 0, num_workers: int = 2, block_bytes: int = 2 * MiB,
                 checkpoint_every: int = 5000, producer: str = "simulate", epoch: int = 1):
        self.rng = random.Random(seed)
        self.state = State()
        self.num_workers = num_workers
        self.block_bytes = block_bytes
        self.checkpoint_every = checkpoint_every
        self.producer, self.epoch = producer, epoch
        self.seq = 0
        self.now = T0_NS
        self.next_block = 0
        self.next_move = 0
        self.next_req = 0
        self.step = 0
        self.sessions: list[str] = []
        self.requests_open: list[str] = []
        self.lost_one = False
        self.pending_late: list[tuple[int, str, int]] = []   # (emit at seq, move_id, worker)

    # ------------------------------------------------------------------ emit
    def _emit(self, event: ev.Event, correlation: str | None = None, causation: str | None = None):
        self.seq += 1
        self.now += self.rng.randint(20_000, 2_000_000)          # 20 us .. 2 ms apart
        env = Envelope(producer=self.producer, epoch=self.epoch, producer_seq=self.seq,
                       ts_ns=self.now, correlation_id=correlation, causation=causation, seq=self.seq)
        fold(self.state, Recorded(env, event))
        return env, event

    def events(self, n: int) -> Iterator[tuple[Envelope, ev.Event]]:
        """Yield exactly ``n`` events (envelopes carry the seq they get in an empty ledger)."""
        for item in self._stream():
            yield item
            if self.seq >= n:
                return

    # ------------------------------------------------------------------ story
    def _stream(self):
        r = self.rng
        yield self._emit(ev.ServerStarted(version="0.1.0", config_digest=f"{r.getrandbits(64):016x}"))
        for w in range(self.num_workers):
            tiers = {"device": 96 * self.block_bytes, "host": 256 * self.block_bytes, "disk": 1024 * self.block_bytes}
            yield self._emit(ev.WorkerJoined(worker=w, device=f"cuda:{w}", tiers=tiers, block_bytes=self.block_bytes))
            yield self._emit(ev.BudgetSet(worker=w, tier="device", floor_bytes=8 * self.block_bytes,
                                          ceiling_bytes=96 * self.block_bytes))
            yield self._emit(ev.PinnedRegistered(worker=w, owner="host_pool", bytes=tiers["host"]))
            yield self._emit(ev.WeightsLoaded(worker=w, arena="weights", model="smollm2-135m", bytes=270 * MiB))
        while True:
            if self.seq % self.checkpoint_every == self.checkpoint_every - 1:
                yield self._emit(ev.StateCheckpoint(through_seq=self.seq, state_hash=state_hash(self.state)))
                continue
            if self.pending_late and self.pending_late[0][0] <= self.seq:
                _, mid, w = self.pending_late.pop(0)
                yield from self._late_ack(mid, w)
                continue
            yield from self._one_action()

    def _alive(self) -> list[int]:
        return [w for w, ws in self.state.workers.items() if ws.alive]

    def _free(self, w: int, tier: str) -> int:
        acc = self.state.workers[w].tiers[tier]
        return acc.capacity_bytes - acc.used_bytes - acc.inflight_in_bytes

    def _blocks_on(self, w: int, tier: str, only: bool = False) -> list[int]:
        return [b for b, st in self.state.blocks.get(w, {}).items()
                if tier in st.tiers and (not only or len(st.tiers) == 1)]

    def _one_action(self):
        r = self.rng
        alive = self._alive()
        if not alive:
            w = 0
            ws = self.state.workers[w]
            yield self._emit(ev.WorkerJoined(worker=w, device=ws.device,
                                             tiers={t: a.capacity_bytes for t, a in ws.tiers.items()},
                                             block_bytes=ws.block_bytes))
            return
        w = r.choice(alive)
        lost = [x for x, ws in self.state.workers.items() if not ws.alive]
        if lost and r.random() < 0.002:
            ws = self.state.workers[lost[0]]
            yield self._emit(ev.WorkerJoined(worker=ws.worker, device=ws.device,
                                             tiers={t: a.capacity_bytes for t, a in ws.tiers.items()},
                                             block_bytes=ws.block_bytes))
            return
        # Under pressure a real policy relieves the tier first: do the same.
        for tier, relief in (("device", 0.6), ("host", 0.5), ("disk", 0.5)):
            acc = self.state.workers[w].tiers[tier]
            if acc.used_bytes + acc.inflight_in_bytes > 0.8 * acc.capacity_bytes and r.random() < relief:
                if tier == "device":
                    yield from r.choice([self._park, self._free_blocks])(w) if r.random() < 0.5 else \
                        self._move(w, "evict", "device", "host")
                elif tier == "host":
                    yield from self._move(w, "demote", "host", "disk") if r.random() < 0.4 else self._free_blocks(w, "host")
                else:
                    yield from self._free_blocks(w, "disk")
                return
        roll = r.random()
        if roll < 0.22:
            yield from self._request(w)
        elif roll < 0.36:
            yield from self._step(w)
        elif roll < 0.55:
            yield from self._move(w, r.choice(["spill", "evict", "spill"]), "device", "host")
        elif roll < 0.63:
            yield from self._park(w)
        elif roll < 0.75:
            src = "host" if r.random() < 0.8 else "disk"
            yield from self._move(w, "restore", src, "device", keep=r.random() < 0.5)
        elif roll < 0.80:
            yield from self._move(w, "demote", "host", "disk")
        elif roll < 0.83:
            yield from self._move(w, "promote", "disk", "host", keep=True)
        elif roll < 0.90:
            yield from self._free_blocks(w)
        elif roll < 0.93:
            yield from self._refusal(w)
        elif roll < 0.95:
            yield from self._rebind(w)
        elif roll < 0.965:
            yield from self._flip(w)
        elif roll < 0.975 and not self.lost_one and self.seq > 2000 and len(alive) > 1:
            yield from self._lose_worker(w)
        else:
            yield self._emit(ev.MoveRefused(ask="policy:restore", worker=w, tier="device",
                                            asked_bytes=r.randint(4, 64) * self.block_bytes,
                                            available_bytes=max(0, self._free(w, "device")),
                                            floor_bytes=self.state.workers[w].tiers["device"].floor_bytes,
                                            reason="device below floor after restore"))

    def _request(self, w: int):
        r = self.rng
        if self.requests_open and r.random() < 0.5:
            rid = self.requests_open.pop(0)
            yield self._emit(ev.RequestFinished(request_id=rid, reason=r.choice(["stop", "stop", "length"]),
                                                completion_tokens=r.randint(1, 512)), correlation=rid)
            return
        self.next_req += 1
        rid = f"req-{self.next_req}"
        if not self.sessions or r.random() < 0.3:
            self.sessions.append(f"s-{r.getrandbits(32):08x}")
        session = r.choice(self.sessions)
        n = r.randint(1, 6)
        if self._free(w, "device") < n * self.block_bytes:
            yield self._emit(ev.RequestRefused(request_id=rid, reason="device pool full"), correlation=rid)
            return
        yield self._emit(ev.RequestAdmitted(request_id=rid, session=session, prompt_tokens=n * 16 - r.randint(0, 15)),
                         correlation=rid)
        self.requests_open.append(rid)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        keys = [f"{r.getrandbits(64):016x}" for _ in blocks]
        yield self._emit(ev.BlocksCommitted(worker=w, session=session, tier="device", blocks=blocks, keys=keys,
                                            bytes=n * self.block_bytes), correlation=rid)

    def _step(self, w: int):
        r = self.rng
        self.step += 1
        yield self._emit(ev.StepCompleted(worker=w, step=self.step, batch_digest=f"{r.getrandbits(32):08x}",
                                          num_seqs=r.randint(1, 64), num_tokens=r.randint(1, 4096),
                                          duration_ns=r.randint(2_000_000, 40_000_000)))

    def _move(self, w: int, kind: str, src: str, dst: str, keep: bool | None = None, blocks=None, session=None):
        r = self.rng
        if blocks is None:
            cands = [b for b in self._blocks_on(w, src) if dst not in self.state.blocks[w][b].tiers]
            cands = [b for b in cands if not any(b in m.blocks for m in self.state.inflight.values())]
            if not cands:
                return
            blocks = r.sample(cands, min(len(cands), r.randint(1, 8)))
        if keep is None:
            keep = kind == "spill"
        nbytes = len(blocks) * self.block_bytes
        free = self._free(w, dst)
        acc = self.state.workers[w].tiers[dst]
        if free < nbytes:
            yield self._emit(ev.MoveRefused(ask=f"policy:{kind}", worker=w, tier=dst, asked_bytes=nbytes,
                                            available_bytes=max(free, 0), floor_bytes=acc.floor_bytes,
                                            reason=f"{dst} has no room", session=session))
            return
        self.next_move += 1
        mid = f"m-{self.next_move}"
        deadline = self.now + 50_000_000
        yield self._emit(ev.MoveRequested(move_id=mid, kind=kind, worker=w, src=src, dst=dst, blocks=blocks,
                                          bytes_planned=nbytes, keep_source=keep, deadline_ns=deadline,
                                          reason="pressure" if kind != "restore" else "turn", session=session),
                         correlation=session, causation=None)
        yield self._emit(ev.MoveDispatched(move_id=mid, worker=w), causation=mid)
        roll = r.random()
        if roll < 0.90:
            started = self.now
            yield self._emit(ev.MoveAcked(move_id=mid, worker=w, bytes_moved=nbytes,
                                          bytes_freed_src=0 if keep else nbytes, checksum_ok=True,
                                          started_ns=started, finished_ns=started + nbytes // 50),
                             causation=mid)
        elif roll < 0.94:
            yield self._emit(ev.MoveFailed(move_id=mid, worker=w, error="checksum mismatch on block "
                                           f"{blocks[0]}", bytes_moved=r.choice([None, 0, nbytes // 2])), causation=mid)
        elif roll < 0.96:
            yield self._emit(ev.MoveRejected(move_id=mid, worker=w, reason="destination full at worker",
                                             asked_bytes=nbytes, available_bytes=nbytes - self.block_bytes,
                                             blocks=blocks), causation=mid)
        else:
            yield self._emit(ev.MoveStranded(move_id=mid, worker=w, bytes_at_risk=nbytes, why="deadline"),
                             causation=mid)
            if r.random() < 0.6:
                self.pending_late.append((self.seq + r.randint(3, 200), mid, w))

    def _late_ack(self, mid: str, w: int):
        mv = self.state.stranded.get(mid)
        if mv is None or not self.state.workers[w].alive:
            return
        blocks = self.state.blocks.get(w, {})
        if not all(b in blocks and mv.src in blocks[b].tiers for b in mv.blocks):
            return
        if any(mv.dst in blocks[b].tiers for b in mv.blocks) or self._free(w, mv.dst) < mv.bytes_planned:
            return
        yield self._emit(ev.MoveLateAcked(move_id=mid, worker=w, bytes_moved=mv.bytes_planned,
                                          bytes_freed_src=0 if mv.keep_source else mv.bytes_planned,
                                          checksum_ok=True, started_ns=self.now, finished_ns=self.now + 1000),
                         causation=mid)

    def _park(self, w: int):
        r = self.rng
        owned: dict[str, list[int]] = {}
        for b, st in self.state.blocks.get(w, {}).items():
            if st.session and "device" in st.tiers and "host" not in st.tiers:
                owned.setdefault(st.session, []).append(b)
        busy = {b for m in self.state.inflight.values() for b in m.blocks}
        owned = {s: bl for s, bl in owned.items() if not busy.intersection(bl)}
        if not owned:
            return
        session = r.choice(sorted(owned))
        blocks = owned[session]
        before = self.seq
        yield from self._move(w, "park", "device", "host", keep=False, blocks=blocks, session=session)
        mid = f"m-{self.next_move}"
        if self.seq > before and self.state.outcomes.get(mid) == "MoveAcked":
            yield self._emit(ev.SessionParked(session=session, worker=w, tier="host",
                                              bytes=len(blocks) * self.block_bytes, move_id=mid), correlation=session)
            if r.random() < 0.7:
                yield from self._move(w, "restore", "host", "device", keep=r.random() < 0.5, blocks=blocks,
                                      session=session)
                rid = f"m-{self.next_move}"
                if self.state.outcomes.get(rid) == "MoveAcked":
                    yield self._emit(ev.SessionRestored(session=session, worker=w, restored_tokens=len(blocks) * 16,
                                                        computed_tokens=r.randint(1, 40), move_id=rid),
                                     correlation=session)

    def _free_blocks(self, w: int, tier: str | None = None):
        r = self.rng
        tier = tier or r.choice(["device", "device", "host", "disk"])
        pending = {mid for _, mid, _ in self.pending_late}
        busy = {b for m in self.state.inflight.values() for b in m.blocks}
        busy |= {b for mid, m in self.state.stranded.items() if mid in pending for b in m.blocks}
        cands = [b for b in self._blocks_on(w, tier) if b not in busy]
        if not cands:
            return
        blocks = r.sample(cands, min(len(cands), r.randint(1, 6)))
        reason = r.choice(["finished", "finished", "disconnected", "dropped", "release"])
        if reason == "release":
            yield from self._release(w, tier, blocks)
            return
        yield self._emit(ev.BlocksFreed(worker=w, tier=tier, blocks=blocks, bytes=len(blocks) * self.block_bytes,
                                        reason=reason))

    def _release(self, w: int, tier: str, blocks: list[int]):
        """Copies freed by the book, as the serving side frees superseded pages: requested write-ahead
        like a move that copies nothing, answered by what the worker freed."""
        self.next_move += 1
        mid = f"m-{self.next_move}"
        nbytes = len(blocks) * self.block_bytes
        yield self._emit(ev.MoveRequested(move_id=mid, kind="evict", worker=w, src=tier, dst=tier, blocks=blocks,
                                          bytes_planned=nbytes, keep_source=True, deadline_ns=self.now + 50_000_000,
                                          reason="release:superseded"))
        yield self._emit(ev.MoveDispatched(move_id=mid, worker=w), causation=mid)
        yield self._emit(ev.CopiesReleased(move_id=mid, worker=w, tier=tier, blocks=blocks, bytes=nbytes), causation=mid)

    def _refusal(self, w: int):
        r = self.rng
        acc = self.state.workers[w].tiers["device"]
        asked = r.randint(16, 128) * self.block_bytes
        avail = max(0, self._free(w, "device"))
        for _ in range(r.choice([1, 1, 3])):      # sometimes the same ask again (a small storm)
            yield self._emit(ev.MoveRefused(ask="operator:restore", worker=w, tier="device", asked_bytes=asked,
                                            available_bytes=avail, floor_bytes=acc.floor_bytes,
                                            reason="asked exceeds available above floor"))

    def _rebind(self, w: int):
        r = self.rng
        key = f"rb-{self.seq}"
        gen = sum(1 for rb in self.state.rebinds.values() if rb.worker == w)
        readers = ["scheduler", "worker_views", "host_staging"]
        yield self._emit(ev.RebindRequested(rebind_id=key, worker=w, pool="device", from_gen=gen, to_gen=gen + 1,
                                            readers=readers))
        torn = r.random() < 0.1
        stamped = readers[:-1] if torn else readers
        for reader in stamped:
            yield self._emit(ev.ReaderStamped(rebind_id=key, reader=reader, gen=gen + 1))
        if torn:
            yield self._emit(ev.RebindTorn(rebind_id=key, readers_behind=readers[-1:]))
        else:
            yield self._emit(ev.RebindCommitted(rebind_id=key))

    def _flip(self, w: int):
        r = self.rng
        arena = self.state.arenas.get(f"{w}:weights")
        if arena is None or arena.flip_in_flight:
            return
        fid = f"flip-{self.seq}"
        to_model = "llama3-8b" if arena.model == "smollm2-135m" else "smollm2-135m"
        out_b, in_b = arena.bytes, (15 * GiB if to_model == "llama3-8b" else 270 * MiB)
        yield self._emit(ev.FlipRequested(flip_id=fid, worker=w, arena="weights", from_model=arena.model,
                                          to_model=to_model, bytes_out=out_b, bytes_in=in_b))
        if r.random() < 0.9:
            yield self._emit(ev.FlipCompleted(flip_id=fid, bytes_out=out_b, bytes_in=in_b, started_ns=self.now,
                                              finished_ns=self.now + in_b // 50, overlapped_steps=r.randint(0, 40),
                                              checksum_ok=True))
        else:
            yield self._emit(ev.FlipFailed(flip_id=fid, error="checksum mismatch in incoming image"))

    def _lose_worker(self, w: int):
        self.lost_one = True
        blocks = sorted(self.state.blocks.get(w, {}))
        lost_bytes = len(blocks) * self.block_bytes
        moves = [m for m in self.state.inflight.values() if m.worker == w]
        yield self._emit(ev.WorkerHeartbeatMissed(worker=w, silent_ms=3000))
        yield self._emit(ev.WorkerLost(worker=w, reason="heartbeat silent 10000 ms", blocks_lost=blocks,
                                       bytes_lost=lost_bytes))
        for m in moves:
            yield self._emit(ev.MoveStranded(move_id=m.move_id, worker=w, bytes_at_risk=m.bytes_planned,
                                             why="worker_lost"), causation=m.move_id)


def simulate(n_events: int, seed: int = 0, **kw) -> Iterator[tuple[Envelope, ev.Event]]:
    return Simulator(seed=seed, **kw).events(n_events)
