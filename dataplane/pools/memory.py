"""How much memory a new pool tensor may take on a device, read from the machine.

On CUDA: what the driver counts free plus what torch's caching allocator holds unused (it hands
those bytes out first). On a CPU host: ``MemAvailable`` from /proc/meminfo, the kernel's own
estimate of what can be allocated without swapping.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FreeMemory:
    bytes: int
    source: str           # where the figure came from, for a refusal's arithmetic


def measure_free_memory(device: torch.device) -> FreeMemory:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return FreeMemory(free + cached, f"cuda driver free {free} B + allocator cache {cached} B")
    return FreeMemory(mem_available_bytes(), "MemAvailable in /proc/meminfo")


def mem_available_bytes(path: str = "/proc/meminfo") -> int:
    with open(path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable line in {path}")
