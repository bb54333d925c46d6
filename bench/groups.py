"""Groups: decode at TP=2 against TP=1, and a group spill on both GPUs at once, in one run.

    python bench/groups.py --device cuda                  # 2 GPUs: Llama-3-8B shape, bf16, 2 GiB spill per rank
    python bench/groups.py --device cpu                   # any host: a tiny shape over gloo, 16 MiB spill
    python bench/groups.py --device cuda --out bench/results/groups-<date>-<machine>.json

Plain python: it spawns its two ranks itself (no torchrun); rank r uses cuda:r (nccl) or the CPU
(gloo). Measured in the same run, rounds interleaved so drift hits every case alike:
  decode   tokens/s of pure decode steps (--batch sizes, --context tokens of random KV already in
           the pool, random bf16 weights: speed only). TP=1 is rank 0 alone holding the whole
           model (rank 1 idles at a barrier); TP=2 is both ranks, each holding its half
           (``random_shard_weights``). Eager (``runner.forward``) and, on CUDA, CUDA graphs
           (``DecodeGraphs``; the all-reduces are captured with the rest) where capture works.
  spill    device -> pinned host copy of --spill-gib per rank: each rank alone (the single-GPU
           ceiling of this run) and both ranks at once from a common start (the group's aggregate
           = bytes of both / (last finish - first start)). The copies are checked.
Targets: TP=2 decode at batch 1 >= 1.5x TP=1 (``targets.decode_tp2_speedup``), the group spill's
aggregate >= 1.8x the single-GPU ceiling (``targets.group_spill_vs_single``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from commit import git_commit  # noqa: E402
from moves_report import device_name  # noqa: E402

from residency.dataplane.model import LLAMA3_8B, ModelRunner, SeqInput  # noqa: E402
from residency.dataplane.model.tp import close_group, init_group, random_shard_weights  # noqa: E402
from residency.dataplane.model.weights import random_weights  # noqa: E402

GB = 1e9
GiB = 1 << 30
SIZE = 2
# The CPU smoke's shape: Llama-3's structure (GQA 4:1 → here 2:1, untied head), small enough for gloo on a laptop.
TINY = LLAMA3_8B.replace(name="tiny-llama3", num_layers=2, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32,
                         intermediate=512, vocab_size=1000, max_position=4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", default=None, help="decode batch sizes, comma-separated (default 1,16 on cuda; 1,4 on cpu)")
    p.add_argument("--context", type=int, default=None, help="tokens already in each sequence's pages (512; cpu 64)")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per round (32; cpu 8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spill-gib", type=float, default=None, help="bytes each rank spills (2; cpu 1/64)")
    p.add_argument("--no-graphs", action="store_true", help="eager decode only")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < SIZE:
        sys.exit(f"bench/groups.py needs {SIZE} GPUs, this host has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        res_path = os.path.join(tmp, "result.json")
        import torch.multiprocessing as mp
        mp.spawn(rank_main, args=(init, vars(args), res_path), nprocs=SIZE, join=True)
        res = json.loads(Path(res_path).read_text())
    report(res)
    out = args.out or str(Path(__file__).resolve().parent / "results" / f"groups-{res['date']}-{res['machine']}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


# ------------------------------------------------------------------ one rank
def rank_main(rank: int, init: str, a: dict, res_path: str) -> None:
    import torch.distributed as dist

    cuda = a["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    config = LLAMA3_8B if cuda else TINY
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in (a["batch"] or ("1,16" if cuda else "1,4")).split(",")]
    ctx = a["context"] or (512 if cuda else 64)
    steps = a["steps"] or (32 if cuda else 8)
    spill_bytes = int((a["spill_gib"] or (2 if cuda else 1 / 64)) * GiB)
    tp = init_group(rank, SIZE, init, device=dev, timeout_s=300)
    try:
        # TP=1 lives on rank 0 only; TP=2 on both. Both stay resident so rounds can interleave.
        whole = ModelRunner(config, random_weights(config, dev, dtype, seed=1), device=dev, dtype=dtype) \
            if rank == 0 else None
        half = ModelRunner(config, random_shard_weights(config, tp, dev, dtype, seed=2), device=dev, dtype=dtype, tp=tp)
        cases = {(1, b): Decode(whole, b, ctx, steps, seed=b) for b in batches} if rank == 0 else {}
        cases.update({(2, b): Decode(half, b, ctx, steps, seed=b) for b in batches})
        modes = ["eager"] + (["graphs"] if cuda and not a["no_graphs"] else [])
        decode: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        spill: dict[str, list[dict]] = {"rank0": [], "rank1": [], "both": []}
        src = torch.randint(-2**31, 2**31 - 1, (spill_bytes // 4,), dtype=torch.int32,
                            generator=torch.Generator(dev).manual_seed(rank), device=dev)
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
        for _ in range(a["rounds"]):
            for mode in modes:
                for size in (1, 2):
                    for b in batches:
                        name = f"{mode}/tp{size}/b{b}"
                        if name in errors:                    # the same on every rank: agreed below
                            continue
                        case = cases.get((size, b))           # None on rank 1 for TP=1: it idles
                        err = None
                        if case is not None and mode == "graphs" and case.graphs is None:
                            try:
                                case.capture()
                            except Exception as e:  # noqa: BLE001 - reported: capturing collectives may be refused
                                err = f"{type(e).__name__}: {e}"
                        # NOTE: every rank must agree before a timed run: a rank that runs steps its
                        # peer skipped would wait in an all-reduce the peer never enters.
                        if not all_ok(err is None, dev):
                            errors[name] = err or "capture failed on the other rank"
                            continue
                        if case is not None:
                            decode.setdefault(name, []).append(case.tokens_per_s(mode))
                        dist.barrier()
            for who in ("rank0", "rank1", "both"):
                spill[who].append(spill_round(src, dst, rank, who, dev))
        ok = torch.equal(dst[-4096:], src[-4096:].cpu())
        gathered = [None] * SIZE
        dist.all_gather_object(gathered, {"decode": decode, "errors": errors, "copy_ok": ok})
        if rank == 0:
            res = assemble(a, config, dtype, dev, batches, ctx, steps, spill_bytes, gathered, spill)
            Path(res_path).write_text(json.dumps(res))
    finally:
        close_group()


class Decode:
    """Pure decode steps of ``batch`` sequences, each with ``ctx`` tokens of random KV in its pages."""

    def __init__(self, runner: ModelRunner, batch: int, ctx: int, steps: int, seed: int, page: int = 16):
        self.runner, self.batch, self.ctx, self.steps, self.page = runner, batch, ctx, steps, page
        self.per_seq = -(-(ctx + 4 * steps + 8) // page)                # room for every round's new tokens
        n = batch * self.per_seq + 1
        g = torch.Generator(runner.device).manual_seed(seed)
        self.pool = torch.randn(runner.kv_pool_shape(n, page), generator=g, device=runner.device,
                                dtype=torch.float32).to(runner.dtype)
        self.tables = np.arange(batch * self.per_seq, dtype=np.int32).reshape(batch, self.per_seq)
        rng = np.random.default_rng(seed)                                 # the same tokens on every rank
        self.tokens = rng.integers(0, runner.config.vocab_size, size=(4 * steps + 8, batch))
        self.graphs = None

    def capture(self) -> None:
        from residency.dataplane.model.graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self.runner, self.pool, max_blocks_per_seq=self.per_seq,
                                   scratch_slot=self.pool.shape[0] - 1, batch_sizes=(self.batch,))

    def tokens_per_s(self, mode: str) -> float:
        """One timed run of ``steps`` steps (after two untimed ones); positions restart each round,
        so every round decodes over the same context length."""
        cuda = self.runner.device.type == "cuda"
        step = self._graph_step if mode == "graphs" else self._eager_step
        for i in range(2):
            step(i)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        t0 = time.perf_counter()
        for i in range(2, 2 + self.steps):
            step(i)
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        return self.batch * self.steps / (time.perf_counter() - t0)

    def _eager_step(self, i: int) -> None:
        pos = self.ctx + i
        batch = [SeqInput([int(self.tokens[i, b])], pos, self.tables[b].tolist()) for b in range(self.batch)]
        self.runner.forward(batch, self.pool)

    def _graph_step(self, i: int) -> None:
        self.graphs.step(self.tokens[i], np.full(self.batch, self.ctx + i, dtype=np.int64), self.tables, self.pool)


def all_ok(ok: bool, dev: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def spill_round(src: torch.Tensor, dst: torch.Tensor, rank: int, who: str, dev: torch.device) -> dict:
    """One device -> host copy by ``who`` (rank0, rank1 or both) from a common start; each rank's
    (start, finish) on the host's monotonic clock, shared by every process of the host."""
    import torch.distributed as dist

    active = who == "both" or who == f"rank{rank}"
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    t0 = time.monotonic()
    if active:
        dst.copy_(src, non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    t1 = time.monotonic()
    spans = [None] * SIZE
    dist.all_gather_object(spans, (active, t0, t1, src.numel() * src.element_size()))
    act = [s for s in spans if s[0]]
    wall = max(s[2] for s in act) - min(s[1] for s in act)
    return {"bytes": sum(s[3] for s in act), "seconds": wall, "GBps": sum(s[3] for s in act) / wall / GB}


# ------------------------------------------------------------------ results
def assemble(a, config, dtype, dev, batches, ctx, steps, spill_bytes, gathered, spill) -> dict:
    cuda = dev.type == "cuda"
    decode = {name: {"tokens_per_s": statistics.median(v), "runs": v} for name, v in gathered[0]["decode"].items()}
    errors = {**gathered[1]["errors"], **gathered[0]["errors"]}
    med = {who: statistics.median(r["GBps"] for r in rounds) for who, rounds in spill.items()}
    single = max(med["rank0"], med["rank1"])
    spill_ratio = med["both"] / single
    speed = {}
    for mode in ("eager", "graphs"):
        for b in batches:
            one, two = decode.get(f"{mode}/tp1/b{b}"), decode.get(f"{mode}/tp2/b{b}")
            if one and two:
                speed[f"{mode}/b{b}"] = two["tokens_per_s"] / one["tokens_per_s"]
    b1 = speed.get("graphs/b1", speed.get("eager/b1"))
    names = [torch.cuda.get_device_name(i) for i in range(SIZE)] if cuda else ["cpu"]
    machine = "cpu" if not cuda else ("h200" if "H200" in names[0] else "h100" if "H100" in names[0] else "gpu")
    return {
        "bench": "groups", "date": dt.date.today().isoformat(), "machine": f"{machine}x{SIZE}" if cuda else machine,
        "devices": [device_name(torch.device("cuda", i)) for i in range(SIZE)] if cuda else ["cpu"],
        "git_commit": git_commit(("dataplane/model", "kernels", "bench/groups.py")), "torch": torch.__version__,
        "config": {"model": config.name, "dtype": str(dtype), "tp": SIZE, "batches": batches, "context": ctx,
                   "steps": steps, "rounds": a["rounds"], "spill_bytes_per_rank": spill_bytes,
                   "backend": "nccl" if cuda else "gloo"},
        "decode": decode, "decode_errors": errors, "decode_speedup_tp2": speed,
        "spill": {"median_GBps": med, "single_gpu_ceiling_GBps": single, "group_vs_single": spill_ratio,
                  "rounds": spill, "copy_ok": all(g["copy_ok"] for g in gathered)},
        "targets": {
            "decode_tp2_speedup": {"measured": None if b1 is None else round(b1, 3), "target": 1.5,
                                   "met": b1 is not None and b1 >= 1.5, "at": "batch 1, graphs where captured"},
            "group_spill_vs_single": {"measured": round(spill_ratio, 3), "target": 1.8, "met": spill_ratio >= 1.8},
        },
    }


def report(res: dict) -> None:
    c = res["config"]
    print(f"\ndecode, {c['model']} shape, {c['dtype']}, context {c['context']}, {c['backend']}: tokens/s (median of "
          f"{c['rounds']} rounds of {c['steps']} steps)")
    print(f"{'mode':<8}{'batch':>6}{'TP=1':>12}{'TP=2':>12}{'TP2/TP1':>10}")
    for mode in ("eager", "graphs"):
        for b in c["batches"]:
            one, two = res["decode"].get(f"{mode}/tp1/b{b}"), res["decode"].get(f"{mode}/tp2/b{b}")
            if one is None and two is None:
                continue
            f = lambda d: f"{d['tokens_per_s']:>12.1f}" if d else f"{'-':>12}"  # noqa: E731
            s = res["decode_speedup_tp2"].get(f"{mode}/b{b}")
            print(f"{mode:<8}{b:>6}{f(one)}{f(two)}{(f'{s:.2f}' if s else '-'):>10}")
    for name, err in res["decode_errors"].items():
        print(f"  {name}: not measured ({err[:160]})")
    s = res["spill"]
    print(f"\ngroup spill, device -> pinned host, {c['spill_bytes_per_rank'] / GiB:.3g} GiB per rank (copies ok: "
          f"{s['copy_ok']})")
    for who in ("rank0", "rank1", "both"):
        print(f"  {who:<6}{s['median_GBps'][who]:>10.2f} GB/s")
    print(f"  both / single-GPU ceiling: {s['group_vs_single']:.2f}")
    for k, t in res["targets"].items():
        print(f"target {k}: {t['measured']} (want >= {t['target']}): {'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
