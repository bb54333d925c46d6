"""``residency serve --tp N``: the workers of one tensor-parallel group, their devices and their
rendezvous (docs/groups.md).

    workers 0..N-1    rank r is worker r; on a GPU host rank r runs on cuda:r (NCCL), on a CPU
                      host every rank runs on the CPU (gloo)
    rendezvous        two free local ports chosen here, once: the process group's (``--group-init``)
                      and the store on which the ranks agree their steps (``--group-store``)
"""
from __future__ import annotations

import socket

from residency.control.cli.main import UserError
from residency.control.cli.supervisor import visible_gpus

GROUP = "tp0"


def plan_group(args) -> list[str]:
    """The device of each rank, in rank order; refuses what cannot run."""
    n = args.tp
    if args.workers not in (None, n):
        raise UserError(f"--tp {n} runs {n} workers, one per rank; --workers {args.workers} says otherwise")
    if args.model in (None, "", "none"):
        raise UserError("--tp shards a model: it needs --model (or the embedded default), not 'none'")
    gpus = visible_gpus() if args.device in ("auto", "cuda") else 0
    if args.device == "cuda" and gpus < n:
        raise UserError(f"--tp {n} on CUDA needs {n} GPUs, one per rank; {gpus} visible")
    if gpus >= n and args.device != "cpu":
        return [f"cuda:{r}" for r in range(n)]
    if args.device == "auto" and gpus:
        raise UserError(f"--tp {n}: {gpus} GPU(s) visible, one per rank is needed (or --device cpu)")
    return ["cpu"] * n


def group_plan(args, devices: list[str]) -> dict[str, list[int]]:
    return {GROUP: list(range(len(devices)))} if getattr(args, "tp", 1) > 1 else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rendezvous(args) -> tuple[str, str] | None:
    """(process group init, store) addresses, chosen once for the life of this serve."""
    if getattr(args, "tp", 1) <= 1:
        return None
    return f"tcp://127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"


def group_argv(args, worker: int, rendezvous: tuple[str, str] | None) -> list[str]:
    if rendezvous is None:
        return []
    init, store = rendezvous
    return ["--group", GROUP, "--rank", str(worker), "--ranks", str(args.tp), "--group-init", init,
            "--group-store", store]
