"""Block moves between the device pool and pinned host memory, against the link's ceiling.

    python bench/moves.py                      # 1024 blocks x 2 MiB (32 layers x K/V x 32 KiB)
    python bench/moves.py --quick              # tiny sizes, any host (checks the script runs)
    python bench/moves.py --out results.json

Measured in one run (medians over --reps; every figure in GB/s = 1e9 B/s and as a fraction of the
ceiling measured in the same run, JSON keys ``*_fraction_of_ceiling``):
  ceiling           one contiguous pinned copy of the same bytes (cudaMemcpyAsync), each direction,
                    and both directions at once on two streams
  spill             Mover.execute(evict device->host) of 1024 scattered blocks, checksums included
  restore           Mover.execute(restore host->device) of the same, verified before visible
  both              a spill and a restore in flight together (submit_many, wait, wait; and
                    submit, submit, wait, wait)
  copy modes        the mover's "dma" (one DMA per 2 MiB block) and "staged" (gather/scatter via
                    a device staging buffer, then one DMA per 64 MiB chunk) paths and the bench's
                    "kernel" (Triton gather/scatter straight to/from pinned host; moves_variants.py),
                    each measured; the headline figures use the mover's mode per direction
  baselines         per-chunk memcpy (32 KiB pages one by one, the layer-first way) and per-block memcpy
  checksum cost     mover spill vs mover spill with hashing switched off (``no_checksums``);
                    and the mover without hashing vs the bare copy path (bookkeeping, launches)
  phases            where a move's wall time goes on the host clock: validate, begin (enqueue),
                    wait (until the copies are seen complete), commit
  latency           one-block spill and restore, p50/p99 over --latency-iters
  host CPU          process CPU time per GiB moved (blocking-sync events: waiting costs no CPU)
  overlap           a spill while bf16 matmuls run on the compute stream: both slowdowns
Bandwidths are wall-clock (host clock from enqueue to the host seeing completion), ceiling too.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from functools import partial

import torch  # noqa: E402

from residency.dataplane.moves.dma import RawDma, TorchDma  # noqa: E402
from residency.dataplane.mover import Mover, copy_modes_for  # noqa: E402
from residency.dataplane.pools import KVLayout  # noqa: E402
from residency.events.catalog import MoveAcked  # noqa: E402
from residency.events.commands import CommitBlocks, ExecuteMove  # noqa: E402
from residency.kernels.checksum import block_checksums  # noqa: E402
from moves_parts import GB, both_over_one, no_checksums, phases, probe_bidir, sync, timed  # noqa: E402,F401
from moves_report import TARGETS, device_name, git_commit, table, triton_version  # noqa: E402,F401
from moves_variants import BenchCopier, Lanes  # noqa: E402





class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = torch.device("cuda:0" if torch.cuda.is_available() and not args.cpu else "cpu")
        self.layout = KVLayout(args.layers, args.page_tokens, args.kv_heads, args.head_dim, torch.bfloat16)
        self.n = args.blocks
        self.bytes = self.n * self.layout.block_bytes
        self.rng = random.Random(args.seed)
        self.res: dict = {"errors": {}}
        host_bytes = 2 * self.n * self.layout.block_bytes
        need = Mover.pinned_bytes_needed(self.layout, 2 * self.n, host_bytes)
        self.tmp = tempfile.TemporaryDirectory()
        # The mover's copier, plus the bench's "kernel" mode and DMA lanes (one unless asked).
        self.lanes = Lanes(getattr(args, "dma_lanes", None) or 1)
        # The ceiling's two host buffers are pinned through the same budget as everything else.
        self.e = Mover(self.layout, 2 * self.n, host_bytes, self.tmp.name, need + 2 * self.bytes + 8192,
                       device=str(self.dev), fsync=False, pipeline_blocks=args.pipeline_blocks,
                       dma=self.dma_variant(args), copier=partial(BenchCopier, lanes=self.lanes))
        words = self.layout.block_words
        self.h_a = self.e.pinned.alloc("bench-ceiling-a", (self.n, words), torch.int32)
        self.h_b = self.e.pinned.alloc("bench-ceiling-b", (self.n, words), torch.int32)
        self.d_a = torch.randint(-(2**31), 2**31, (self.n, words), dtype=torch.int32, device=self.dev)
        self.d_b = torch.empty_like(self.d_a)
        self.h_a.tensor.copy_(self.d_a.cpu() if self.dev.type == "cpu" else self.d_a)
        ids = list(range(2 * self.n))
        self.e.commit_blocks(CommitBlocks(request_id="bench", session=None, tier="device", blocks=ids, seed=7))
        self.rng.shuffle(ids)
        self.A, self.B = ids[: self.n], ids[self.n:]   # interleaved at random over the pool's slots
        self.k = 0

    # ------------------------------------------------------------ helpers
    def mv(self, kind, src, dst, blocks, keep=False) -> ExecuteMove:
        self.k += 1
        blocks = list(blocks)
        self.rng.shuffle(blocks)                       # scattered order on both sides
        return ExecuteMove(move_id=f"b{self.k}", kind=kind, src=src, dst=dst, blocks=blocks,
                           keep_source=keep, deadline_ns=0)

    def run(self, cmd) -> tuple[MoveAcked, float, float]:
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = self.e.execute(cmd)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        if not isinstance(out, MoveAcked):
            raise RuntimeError(f"{cmd.kind} failed: {out}")
        return out, wall, cpu

    def frac(self, gbps: float, ceiling: float) -> float:
        return round(gbps / ceiling, 4) if ceiling else float("nan")

    # ------------------------------------------------------------ sections
    def ceiling(self):
        """Plain contiguous pinned copies of the same bytes: one way each, and both ways at once on
        two streams, a round of the three per rep (drift of the link hits all three alike)."""
        d, h_a, h_b = self.dev, self.h_a.tensor, self.h_b.tensor
        d2h, h2d, both = [], [], []
        for _ in range(self.args.reps):
            d2h.append(timed(d, lambda: h_b.copy_(self.d_a, non_blocking=True)))
            h2d.append(timed(d, lambda: self.d_b.copy_(h_a, non_blocking=True)))
            both.append(self.bare_both())
        r = self.res
        r["ceiling_d2h_GBps"] = self.bytes / statistics.median(d2h) / GB
        r["ceiling_h2d_GBps"] = self.bytes / statistics.median(h2d) / GB
        r["ceiling_bidir_GBps"] = 2 * self.bytes / statistics.median(both) / GB
        # What this host's link allows "both at once" to reach over one direction: the bare
        # bidirectional copy over the mean bare one-way copy (it varies from host to host),
        # from the medians, and per round (``_paired``: the median of the rounds' own ratios).
        r["hardware_both_vs_one_direction"] = round(
            r["ceiling_bidir_GBps"] / ((r["ceiling_d2h_GBps"] + r["ceiling_h2d_GBps"]) / 2), 4)
        r["hardware_both_vs_one_direction_paired"] = round(statistics.median(
            both_over_one(b, o, i) for b, o, i in zip(both, d2h, h2d)), 4)

    @staticmethod
    def dma_variant(args):
        """The DMA issuer asked for: None (the mover's own), torch's copies, or one call per run."""
        if getattr(args, "torch_dma", False):
            return TorchDma()
        if getattr(args, "no_batch_dma", False) and torch.cuda.is_available() and not getattr(args, "cpu", False):
            return RawDma.load(batch=False)
        return None

    def engine_modes(self):
        """Per copy mode: spill (evict A) and restore (A back), with and without checksums, and the
        bare copy path both ways; reps interleaved so drift hits every variant alike."""
        r = self.res
        r["modes"] = {}
        warm = self.A[:8]
        gib = self.bytes / 2**30
        for mode in ("kernel", "dma", "staged"):
            self.e.ctx.copy_modes.update(d2h=mode, h2d=mode)        # the mover's copier is BenchCopier
            self.run(self.mv("evict", "device", "host", warm))             # compile, warm caches
            self.run(self.mv("restore", "host", "device", warm))
            t = {k: [] for k in ("spill", "restore", "cpu_s", "cpu_r", "copy_d2h", "copy_h2d",
                                 "spill_nohash", "restore_nohash")}
            ph = {"spill": [], "restore": []}
            for _ in range(self.args.reps):
                ack, wall, cpu = self.run(self.mv("evict", "device", "host", self.A))
                t["spill"].append(wall)
                t["cpu_s"].append(cpu)
                ph["spill"].append(phases(self.e.last_phases))
                t["copy_h2d"].append(self.copy_only("h2d"))
                ack, wall, cpu = self.run(self.mv("restore", "host", "device", self.A))
                t["restore"].append(wall)
                t["cpu_r"].append(cpu)
                ph["restore"].append(phases(self.e.last_phases))
                t["copy_d2h"].append(self.copy_only("d2h"))
                with no_checksums():
                    t["spill_nohash"].append(self.run(self.mv("evict", "device", "host", self.A))[1])
                    t["restore_nohash"].append(self.run(self.mv("restore", "host", "device", self.A))[1])
            gbps = {k: self.bytes / statistics.median(v) / GB for k, v in t.items() if not k.startswith("cpu")}
            m = {
                "spill_GBps": gbps["spill"], "restore_GBps": gbps["restore"],
                "copy_only_d2h_GBps": gbps["copy_d2h"], "copy_only_h2d_GBps": gbps["copy_h2d"],
                "spill_no_checksum_GBps": gbps["spill_nohash"], "restore_no_checksum_GBps": gbps["restore_nohash"],
                "spill_host_cpu_ms_per_GiB": 1e3 * statistics.median(t["cpu_s"]) / gib,
                "restore_host_cpu_ms_per_GiB": 1e3 * statistics.median(t["cpu_r"]) / gib,
                "spill_phases_us": {k: statistics.median(p[k] for p in ph["spill"]) for k in ph["spill"][0]},
                "restore_phases_us": {k: statistics.median(p[k] for p in ph["restore"]) for k in ph["restore"][0]},
            }
            for k in ("spill", "copy_only_d2h", "spill_no_checksum"):
                m[k + "_fraction_of_ceiling"] = self.frac(m[k + "_GBps"], r["ceiling_d2h_GBps"])
            for k in ("restore", "copy_only_h2d", "restore_no_checksum"):
                m[k + "_fraction_of_ceiling"] = self.frac(m[k + "_GBps"], r["ceiling_h2d_GBps"])
            # what the checksum costs a spill, and what the rest of the mover costs on top of the copy
            m["spill_checksum_cost_fraction"] = round(1 - m["spill_GBps"] / m["spill_no_checksum_GBps"], 4)
            m["spill_engine_overhead_fraction"] = round(1 - m["spill_no_checksum_GBps"] / m["copy_only_d2h_GBps"], 4)
            r["modes"][mode] = m

    def copy_only(self, direction: str) -> float:
        """The mover's copy path for the same scattered blocks, with no checksum and no bookkeeping.

        d2h runs while the host pool is empty (writes its first slots); h2d runs while A is on the
        host (reads A's host rows in slot order, writes the device slots A's restore will reserve).
        """
        dp, hp, ctx = self.e.device_pool, self.e.host_pool, self.e.ctx
        if direction == "d2h":
            ids = list(self.A)
            self.rng.shuffle(ids)
            src, src_slots = dp.words, dp.slots_of(ids)
            dst, dst_slots = hp.words, list(range(len(ids)))
        else:
            src, src_slots = hp.words, sorted(hp.slots_of(self.A))
            dst, dst_slots = dp.words, sorted(dp.table._free)[: len(self.A)]

        def go():
            copier = ctx.copier(ctx, direction, src, src_slots, dst, dst_slots)
            copier.enqueue(0, len(src_slots))
            copier.done().synchronize()
        return timed(self.dev, go)

    def bare_both(self) -> float:
        """Seconds for the ceiling's plain bidirectional copy (2 GiB each way, two streams)."""
        d, h_a, h_b = self.dev, self.h_a.tensor, self.h_b.tensor
        if d.type != "cuda":
            return timed(d, lambda: (h_b.copy_(self.d_a), self.d_b.copy_(h_a)))
        if not hasattr(self, "_bare_streams"):       # two plain streams, made once
            self._bare_streams = (torch.cuda.Stream(d), torch.cuda.Stream(d))
        s1, s2 = self._bare_streams

        def go():
            with torch.cuda.stream(s1):
                h_b.copy_(self.d_a, non_blocking=True)
            with torch.cuda.stream(s2):
                self.d_b.copy_(h_a, non_blocking=True)
        return timed(d, go)

    def both_at_once(self, d2h: str, h2d: str, together: bool = True, bare: bool = False) -> tuple[float, float]:
        """Spill B while A is restored, aggregate GB/s: both begun by Mover.submit_many (each
        reaches the link before either does its bookkeeping) or, ``together=False``, by two
        submits one after the other; then wait for both. Also returns the median over the rounds
        of each round's rate over its own one-way moves (``both_over_one``)."""
        self.e.ctx.copy_modes.update(d2h=d2h, h2d=h2d)
        walls, ratios, bares = [], [], []
        for _ in range(self.args.both_reps or self.args.reps):
            spill_wall = self.run(self.mv("evict", "device", "host", self.A))[1]
            out_cmd, in_cmd = self.mv("evict", "device", "host", self.B), self.mv("restore", "host", "device", self.A)
            sync(self.dev)
            t0 = time.perf_counter()
            if together:
                t_out, t_in = self.e.submit_many([out_cmd, in_cmd])
            else:
                t_out = self.e.submit(out_cmd)
                t_in = self.e.submit(in_cmd)
            a, b = self.e.wait(t_in), self.e.wait(t_out)
            walls.append(time.perf_counter() - t0)
            self.res.setdefault("both_walls_ms", {}).setdefault(f"{d2h}/{h2d}/{'many' if together else 'two'}", []).append(
                round(1e3 * walls[-1], 2))
            assert isinstance(a, MoveAcked) and isinstance(b, MoveAcked), (a, b)
            restore_wall = self.run(self.mv("restore", "host", "device", self.B))[1]
            # the round's own one-direction moves: the spill that set it up, the restore that undoes it
            ratios.append(both_over_one(walls[-1], spill_wall, restore_wall))
            if bare:      # and the bare copy both ways, same seconds: what the link allowed this round
                bares.append(self.bare_both() / walls[-1])
        key = f"{d2h}/{h2d}/{'many' if together else 'two'}"
        if bare:
            self.res["both_fraction_of_bare_both_rounds"] = [round(x, 4) for x in bares]
            self.res["both_fraction_of_bare_both_paired"] = round(statistics.median(bares), 4)
        self.res.setdefault("both_vs_one_direction_paired_rounds", {})[key] = [round(x, 4) for x in ratios]
        return 2 * self.bytes / statistics.median(walls) / GB, statistics.median(ratios)

    def bidir_probe(self):
        probe_bidir(self)

    def both(self, into: dict, d2h: str, h2d: str, bare: bool = False) -> None:
        into["both_GBps"], paired = self.both_at_once(d2h, h2d, bare=bare)
        into["both_vs_one_direction_paired"] = round(paired, 4)
        into["both_sequential_submits_GBps"] = self.both_at_once(d2h, h2d, together=False)[0]
        one = (into["spill_GBps"] + into["restore_GBps"]) / 2
        into["both_vs_one_direction"] = round(into["both_GBps"] / one, 4)
        into["both_fraction_of_ceiling"] = self.frac(into["both_GBps"], self.res["ceiling_bidir_GBps"])
        hw = self.res.get("hardware_both_vs_one_direction")
        if hw:
            into["both_vs_one_direction_fraction_of_hardware"] = round(into["both_vs_one_direction"] / hw, 4)

    def baselines(self):
        """Per-chunk memcpy (layer-first pages, 32 KiB each) and per-block memcpy (2 MiB each)."""
        r, d = self.res, self.dev
        dp, hw = self.e.device_pool, self.h_b.tensor
        chunks = 2 * self.layout.num_layers
        cw = self.layout.block_words // chunks
        sub = self.A[: max(1, min(len(self.A), self.args.chunk_blocks))]
        slots = dp.slots_of(sub)
        src = dp.words.view(dp.num_slots, chunks, cw)
        dst = hw.view(self.n, chunks, cw)

        def per_chunk_d2h():
            for i, s in enumerate(slots):
                for c in range(chunks):
                    dst[i, c].copy_(src[s, c], non_blocking=True)

        def per_chunk_h2d():
            for i, s in enumerate(slots):
                for c in range(chunks):
                    src[s, c].copy_(dst[i, c], non_blocking=True)
        sub_bytes = len(sub) * self.layout.block_bytes
        r["per_chunk_memcpy_d2h_GBps"] = sub_bytes / timed(d, per_chunk_d2h) / GB
        r["per_chunk_memcpy_h2d_GBps"] = sub_bytes / timed(d, per_chunk_h2d) / GB
        all_slots = dp.slots_of(self.A)
        w = dp.words

        def per_block_d2h():
            for i, s in enumerate(all_slots):
                hw[i].copy_(w[s], non_blocking=True)
        r["per_block_memcpy_d2h_GBps"] = statistics.median(
            self.bytes / timed(d, per_block_d2h) / GB for _ in range(self.args.reps))
        for k in ("per_chunk_memcpy_d2h", "per_block_memcpy_d2h"):
            r[k + "_fraction_of_ceiling"] = self.frac(r[k + "_GBps"], r["ceiling_d2h_GBps"])
        r["per_chunk_memcpy_h2d_fraction_of_ceiling"] = self.frac(r["per_chunk_memcpy_h2d_GBps"], r["ceiling_h2d_GBps"])

    def checksum_kernel(self):
        dp = self.e.device_pool
        slots = dp.slots_of(self.A)
        ts = [timed(self.dev, lambda: block_checksums(dp.words, slots, self.A)) for _ in range(self.args.reps)]
        self.res["checksum_kernel_GBps"] = self.bytes / statistics.median(ts) / GB

    def latency(self):
        one = [self.A[0]]
        sp, rs = [], []
        # The first 1-block move compiles Triton specializations a 1024-block move never needs
        # (~125 ms once): reported on its own, outside the percentiles.
        first = [self.run(self.mv(k, s, d, one))[1] for k, s, d in (("evict", "device", "host"),
                                                                     ("restore", "host", "device"))]
        self.res["single_block_first_us"] = {"spill": round(1e6 * first[0], 1), "restore": round(1e6 * first[1], 1)}
        for _ in range(self.args.latency_iters):
            _, w, _ = self.run(self.mv("evict", "device", "host", one))
            sp.append((w, phases(self.e.last_phases)))
            _, w, _ = self.run(self.mv("restore", "host", "device", one))
            rs.append((w, phases(self.e.last_phases)))
        q = lambda xs, p: round(1e6 * sorted(x[0] for x in xs)[min(len(xs) - 1, int(p * len(xs)))], 1)  # noqa: E731
        # the three slowest with their phases: says whether an outlier was the host or the device
        slow = lambda xs: [{"us": round(1e6 * w, 1), **ph} for w, ph in sorted(xs, key=lambda x: -x[0])[:3]]  # noqa: E731
        self.res["single_block_spill_us"] = {"p50": q(sp, 0.5), "p99": q(sp, 0.99), "slowest": slow(sp)}
        self.res["single_block_restore_us"] = {"p50": q(rs, 0.5), "p99": q(rs, 0.99), "slowest": slow(rs)}

    def overlap(self):
        """A spill submitted, then matmuls on the compute stream; both timed against running alone."""
        if self.dev.type != "cuda":
            return
        a = torch.randn(8192, 8192, device=self.dev, dtype=torch.bfloat16)
        k = self.args.matmuls

        def compute():
            for _ in range(k):
                a @ a
        compute_alone = statistics.median(timed(self.dev, compute) for _ in range(3))
        spill_alone = self.bytes / GB / self.res["modes"][self.mode]["spill_GBps"]
        t0 = time.perf_counter()
        ticket = self.e.submit(self.mv("evict", "device", "host", self.A))
        compute()
        ev = torch.cuda.Event()
        ev.record()
        out = self.e.wait(ticket)
        spill_wall = time.perf_counter() - t0
        ev.synchronize()
        both_wall = time.perf_counter() - t0
        assert isinstance(out, MoveAcked), out
        self.run(self.mv("restore", "host", "device", self.A))
        self.res["overlap"] = {
            "spill_alone_ms": 1e3 * spill_alone, "spill_with_compute_ms": 1e3 * spill_wall,
            "compute_alone_ms": 1e3 * compute_alone, "spill_and_compute_ms": 1e3 * both_wall,
            "serial_would_be_ms": 1e3 * (spill_alone + compute_alone),
        }

    # ------------------------------------------------------------ driver
    def main(self):
        r = self.res
        defaults = copy_modes_for(self.e.ctx.dma)    # what the mover uses with this issuer
        r.update(date=time.strftime("%Y-%m-%d"), git_commit=git_commit(), engine_default_copy_modes=defaults,
                 dma_issuer=self.e.ctx.dma.name, dma_lanes=self.lanes.count,
                 dma_batch_refused=getattr(self.e.ctx.dma, "batch_refused", None), device=device_name(self.dev),
                 torch=torch.__version__, triton=triton_version(), blocks=self.n, bytes=self.bytes,
                 layout=dict(num_layers=self.layout.num_layers, page_tokens=self.layout.page_tokens,
                             num_kv_heads=self.layout.num_kv_heads, head_dim=self.layout.head_dim,
                             dtype="bfloat16", block_bytes=self.layout.block_bytes,
                             chunks_per_block=2 * self.layout.num_layers,
                             chunk_bytes=self.layout.page_bytes),
                 host_pinned=self.e.host_pool.pinned, pinning=self.e.host_pool.buffer.how, reps=self.args.reps,
                 pipeline_blocks=self.args.pipeline_blocks)
        # Long-lived set-up objects out of the collector's way, as a worker does once it started:
        # a full collection over them is a ~100 ms pause that has nothing to do with moving bytes.
        import gc

        gc.collect()
        gc.freeze()
        r["gc_frozen_objects"] = gc.get_freeze_count()
        for name in ("ceiling", "bidir_probe", "engine_modes", "baselines", "checksum_kernel"):
            self.section(name, getattr(self, name))
        modes = r.get("modes", {})
        if modes:
            for mode in list(modes):
                self.section(f"both_{mode}", lambda m=mode: self.both(modes[m], m, m))
            # Headline figures: the mover's mode per direction, what a user gets (the
            # fastest per direction in this run is recorded beside it; a 0.1% win of another mode
            # in one run is noise, and mixing modes changes "both at once").
            r["fastest_modes"] = {"d2h": max(modes, key=lambda m: modes[m]["spill_GBps"]),
                                  "h2d": max(modes, key=lambda m: modes[m]["restore_GBps"])}
            best_d2h = defaults["d2h"] if defaults["d2h"] in modes else r["fastest_modes"]["d2h"]
            best_h2d = defaults["h2d"] if defaults["h2d"] in modes else r["fastest_modes"]["h2d"]
            self.mode = best_d2h
            self.e.ctx.copy_modes.update(d2h=best_d2h, h2d=best_h2d)
            r["copy_modes"] = {"d2h": best_d2h, "h2d": best_h2d}
            for key in ("spill_GBps", "spill_fraction_of_ceiling", "spill_checksum_cost_fraction",
                        "spill_engine_overhead_fraction", "copy_only_d2h_GBps", "spill_host_cpu_ms_per_GiB"):
                r[key] = modes[best_d2h][key]
            for key in ("restore_GBps", "restore_fraction_of_ceiling", "copy_only_h2d_GBps",
                        "restore_host_cpu_ms_per_GiB"):
                r[key] = modes[best_h2d][key]
            self.section("both_best", lambda: self.both(r, best_d2h, best_h2d, bare=True))
            self.section("latency", self.latency)
            self.section("overlap", self.overlap)
        r["targets"] = {k: {"target": v, "measured": r.get(k),
                            "met": None if r.get(k) is None else
                            (r[k] <= v if k.endswith("cost_fraction") else r[k] >= v)}
                        for k, v in TARGETS.items()}
        self.e.check_integrity()
        return r

    def section(self, name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            self.res["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"section {name} failed: {e!r}", file=sys.stderr)
        print(f"section {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def close(self):
        self.h_a.close()
        self.h_b.close()
        self.e.close()
        self.tmp.cleanup()






def gpu_bench(name: str, args, why: str = "") -> tuple[Bench, dict] | None:
    """What the GPU-only benches (moves_trace, moves_probe) share: warnings-only logs, the GPU
    check, this bench's mover and blocks, and the JSON header. None (after saying why) without a GPU."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if not torch.cuda.is_available():
        print(f"{name}: needs a GPU{why}")
        return None
    b = Bench(args)
    return b, {"bench": name, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
               "device": device_name(b.dev), "pipeline_blocks": args.pipeline_blocks}


def main(argv=None):
    from residency.control.logconfig import configure_logging

    configure_logging()          # as a worker runs: info level, so per-move debug lines cost nothing
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--both-reps", type=int, default=None,
                   help="spill+restore-at-once repetitions (median; default --reps)")
    p.add_argument("--latency-iters", type=int, default=200)
    p.add_argument("--chunk-blocks", type=int, default=128, help="blocks in the per-chunk memcpy baseline")
    p.add_argument("--pipeline-blocks", type=int, default=64,
                   help="the mover's blocks per pipelined chunk (staging buffer rows; default as the mover's)")
    p.add_argument("--matmuls", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--torch-dma", action="store_true",
                   help="issue the mover's DMAs through torch's copy_ instead of cudaMemcpyAsync (for comparison)")
    p.add_argument("--no-batch-dma", action="store_true",
                   help="one cudaMemcpyAsync per run instead of a cudaMemcpyBatchAsync per call (for comparison)")
    p.add_argument("--dma-lanes", type=int, default=None,
                   help="copy streams per direction for the dma mode (default 1, as the mover)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, measures nothing")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import structlog  # one log line per move would drown the table

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.quick:
        args.blocks, args.layers, args.page_tokens, args.kv_heads, args.head_dim = 16, 2, 4, 2, 16
        args.reps, args.latency_iters, args.chunk_blocks, args.matmuls = 2, 5, 4, 2
    b = Bench(args)
    try:
        res = b.main()
    finally:
        b.close()
    text = json.dumps(res, indent=2, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(table(res))
    return 0 if not res.get("errors") else 1


if __name__ == "__main__":
    raise SystemExit(main())
