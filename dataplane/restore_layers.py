"""Per-layer readiness of pages a restore is still bringing in, as the model runner waits for it.

A returning turn's prefill may start while its history's pages land: layer l of the forward waits
only for layer l's pages (``ModelRunner.forward(..., layer_ready)``). What it waits on is one
object per layer with ``wait()``:

    CUDA   a ``torch.cuda.Event`` recorded on the copy stream after layer l's copies: ``wait()``
           makes the compute stream wait, the host never blocks; from disk, the host first waits
           for the layer to be read (``ReadThenCopied``, dataplane/moves/layered_disk.py)
    CPU    a ``threading.Event`` set by whoever copies layer l (or ``LANDED``: already there)

A step can hold several sequences whose pages land; their waits for layer l are joined here.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from residency.dataplane.model.runner import LayerReady


class _Landed:
    """A layer whose pages are already in place (a CPU restore copies before it returns)."""

    def wait(self) -> None:
        return None


LANDED = _Landed()


class AllOf:
    """Layer l of several sequences: waits for each of them."""

    def __init__(self, waits: Sequence[LayerReady]):
        self.waits = list(waits)

    def wait(self) -> None:
        for w in self.waits:
            w.wait()


def landed(num_layers: int) -> list[LayerReady]:
    """Every layer already in place: the same code path as a landing restore, with nothing to wait for."""
    return [LANDED] * num_layers


def join_layers(per_seq: Sequence[Sequence[LayerReady]], num_layers: int) -> list[LayerReady] | None:
    """One wait per layer for a step holding the sequences of ``per_seq`` (None: nothing lands).
    Raises ValueError for a list whose length is not ``num_layers``."""
    lists = [list(x) for x in per_seq]
    if not lists:
        return None
    bad = [len(x) for x in lists if len(x) != num_layers]
    if bad:
        raise ValueError(f"layer readiness of {bad[0]} layers for a model of {num_layers}")
    if len(lists) == 1:
        return lists[0]
    return [AllOf([x[layer] for x in lists]) for layer in range(num_layers)]


class WaitClock:
    """What the forwards' waits for landing layers cost, as measured where they wait: on the host
    (a CPU gate blocks the thread) or on the compute stream (a CUDA gate: an event pair around
    each ``wait``, read after the step synchronised). ``take`` returns the total and starts again."""

    def __init__(self):
        self.host_ns = 0
        self.pairs: list = []

    def take(self) -> int:
        total = self.host_ns
        for a, b in self.pairs:
            b.synchronize()
            total += int(a.elapsed_time(b) * 1e6)
        self.host_ns, self.pairs = 0, []
        return total


class Timed:
    """A layer's wait, timed into a ``WaitClock``."""

    def __init__(self, wait: LayerReady, clock: WaitClock):
        self.inner, self.clock = wait, clock

    def wait(self) -> None:
        if _on_cuda(self.inner):
            import torch  # noqa: PLC0415

            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.inner.wait()
            b.record()
            self.clock.pairs.append((a, b))
            return
        t0 = time.perf_counter_ns()
        self.inner.wait()
        self.clock.host_ns += time.perf_counter_ns() - t0


def _on_cuda(w) -> bool:
    if isinstance(w, AllOf):
        return any(_on_cuda(x) for x in w.waits)
    # a gate of a restore from disk on a GPU says so (moves/layered_disk.py ReadThenCopied)
    return getattr(w, "on_cuda", False) or type(w).__module__.startswith("torch")


def timed(waits: Sequence[LayerReady], clock: WaitClock) -> list[LayerReady]:
    return [Timed(w, clock) for w in waits]


__all__ = ["AllOf", "LANDED", "Timed", "WaitClock", "join_layers", "landed", "timed"]
