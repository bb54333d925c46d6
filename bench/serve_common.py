"""What the model-runner benches share (bench/serve_model.py, bench/serve_ttft.py): the page size,
a device-synchronised timer, the device-to-device bandwidth (the roofline's denominator),
scattered block tables and a relative error."""
from __future__ import annotations

import statistics
import time

import torch

PAGE = 16


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ timing
class Timer:
    """Wall-clock timing that waits for the device first (CUDA work is asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, repeat: int = 3, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def d2d_bandwidth(device: torch.device) -> float:
    """GB/s of a large device-to-device copy, read + write counted (METHOD.md)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    t = Timer(device)(lambda: b.copy_(a), repeat=10, warmup=3)
    return 2 * n / t / 1e9


# ------------------------------------------------------------------ helpers
def slot_tables(num_seqs: int, blocks_per_seq: int, first: int, gen: torch.Generator) -> list[list[int]]:
    """Scattered, shuffled block tables (the kernel must not profit from contiguity)."""
    perm = (torch.randperm(num_seqs * blocks_per_seq, generator=gen) + first).tolist()
    return [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(num_seqs)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
