"""How many blocks the device KV pool gets when nobody said (``--device-blocks`` not given).

The pool is what is left of this server's share once the weights are in and a reserve for
activations is set aside, measured after the weights load:

    budget  = fraction × total                 the most this server may take in all
    pool    = budget − in_use − reserve        rounded down to whole blocks
    refused when pool < min_blocks × block_bytes (the numbers go in the message)

``total`` and ``in_use`` are measured by ``measure`` (the process shell): on CUDA, the card's
total and everything in use on it after the load (other tenants included, so a card someone
else already uses gives us less, never them an OOM); on a CPU host, the RAM this process could
have had at start (MemAvailable plus its own resident set) and its own resident set after the
load (other processes are already outside MemAvailable). ``size_pool`` is pure.
"""
from __future__ import annotations

import math
import os

import msgspec

from residency.dataplane.pools.errors import DataPlaneError
from residency.events.commands import PoolSizing

# The default share. CUDA: 0.8 of the card leaves a fifth to a co-tenant, the driver and a
# flip's incoming image (vLLM's 0.9 leaves a tenth, which SGLang found too little to share).
# CPU: 0.2 of the RAM free at start, so several servers (the tests start a few at once) and
# the rest of the host keep room.
DEFAULT_FRACTION = {"cuda": 0.8, "cpu": 0.2}
# A pool with no model to say its context (``--model none``) must hold at least this many blocks.
MIN_BLOCKS_NO_MODEL = 16
MIB = 1 << 20


class PoolSizingRefused(DataPlaneError):
    """Weights plus the smallest pool do not fit in the share; ``sizing`` has every number."""

    def __init__(self, sizing: PoolSizing):
        self.sizing = sizing
        super().__init__(explain(sizing))


class StartRefused(DataPlaneError):
    """A worker that cannot start as configured, the message naming the numbers (an expert budget
    that buys no device slot, or one given for a model without experts; models whose KV pages
    differ, a model that cannot fit even alone, a model name given twice): the server stops with
    it, as it does for a refused pool."""


def default_fraction(device: str) -> float:
    return DEFAULT_FRACTION["cuda" if device.startswith("cuda") else "cpu"]


def activation_reserve(device: str, max_step_tokens: int, hidden: int = 0, intermediate: int = 0,
                       vocab: int = 0) -> int:
    """Bytes kept free for one forward step's scratch: the float32 logits and MLP rows of a full
    step, twice over, plus a fixed slack (CUDA: cuBLAS workspaces and graph pools)."""
    per_step = max_step_tokens * 4 * (vocab + 3 * intermediate + 4 * hidden)
    slack = 512 * MIB if device.startswith("cuda") else 64 * MIB
    return 2 * per_step + slack


def size_pool(*, device: str, total_bytes: int, in_use_bytes: int, fraction: float, reserve_bytes: int,
              weights_bytes: int, block_bytes: int, min_blocks: int) -> PoolSizing:
    """The sizing, or raises PoolSizingRefused with the same arithmetic. Pure."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    budget = int(fraction * total_bytes)
    pool = budget - in_use_bytes - reserve_bytes
    num_blocks = max(pool, 0) // block_bytes
    sizing = PoolSizing(how="fraction", device=device, fraction=fraction, total_bytes=total_bytes,
                        budget_bytes=budget, in_use_bytes=in_use_bytes, reserve_bytes=reserve_bytes,
                        weights_bytes=weights_bytes, block_bytes=block_bytes, min_blocks=min_blocks,
                        num_blocks=num_blocks, pool_bytes=num_blocks * block_bytes)
    if num_blocks < min_blocks:
        raise PoolSizingRefused(msgspec.structs.replace(sizing, how="refused"))
    return sizing


def explicit(device: str, num_blocks: int, block_bytes: int, weights_bytes: int) -> PoolSizing:
    """``--device-blocks N``: the operator's count, nothing measured."""
    return PoolSizing(how="explicit", device=device, weights_bytes=weights_bytes, block_bytes=block_bytes,
                      num_blocks=num_blocks, pool_bytes=num_blocks * block_bytes)


def min_blocks_for(max_context: int | None, page_tokens: int) -> int:
    """Enough pages for one sequence of the whole context (no model: MIN_BLOCKS_NO_MODEL)."""
    if not max_context:
        return MIN_BLOCKS_NO_MODEL
    return math.ceil(max_context / page_tokens)


def explain(s: PoolSizing) -> str:
    """The arithmetic in words (logs, the refusal, ``ctl memory``)."""
    if s.how == "explicit":
        return f"device pool: {s.num_blocks} blocks × {s.block_bytes} B = {s.pool_bytes} B (--device-blocks)"
    gib = 1 << 30
    text = (f"budget {s.fraction} × {s.total_bytes / gib:.2f} GiB total = {s.budget_bytes / gib:.2f} GiB; "
            f"in use after the weights load {s.in_use_bytes / gib:.2f} GiB (weights {s.weights_bytes / gib:.2f} GiB); "
            f"activation reserve {s.reserve_bytes / gib:.2f} GiB; left for the KV pool "
            f"{(s.budget_bytes - s.in_use_bytes - s.reserve_bytes) / gib:.2f} GiB = {s.num_blocks} blocks of "
            f"{s.block_bytes} B")
    if s.how == "refused":
        need = s.min_blocks * s.block_bytes
        return (f"the device KV pool does not fit: {text}; the minimum is {s.min_blocks} blocks "
                f"({need / gib:.2f} GiB, one sequence of the whole context). Raise --gpu-memory-fraction, "
                f"free memory on the {s.device} device, or cap --max-context")
    return text


# ---------------------------------------------------------------------- measuring (the shell)
def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def own_rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """Measures ``total`` and ``in_use`` for ``size_pool``. Made before the weights load (a CPU
    host's total is what was free then, plus what this process already held)."""

    def __init__(self, device: str):
        self.device = device
        if device.startswith("cuda"):
            self.total_at_start = None
        else:
            self.total_at_start = meminfo()["MemAvailable"] + own_rss_bytes()

    def measure(self) -> tuple[int, int]:
        """(total_bytes, in_use_bytes) now."""
        if self.device.startswith("cuda"):
            import torch  # noqa: PLC0415

            free, total = torch.cuda.mem_get_info(torch.device(self.device))
            return int(total), int(total - free)
        return self.total_at_start, own_rss_bytes()


__all__ = ["DEFAULT_FRACTION", "PoolSizingRefused", "StartRefused", "default_fraction", "activation_reserve", "size_pool",
           "explicit", "min_blocks_for", "explain", "Meter", "meminfo"]
