"""Per-layer readiness of pages a restore is still bringing in, as the model runner waits for it.

A returning turn's prefill may start while its history's pages land: layer l of the forward waits
only for layer l's pages (``ModelRunner.forward(..., layer_ready)``). What it waits on is one
object per layer with ``wait()``:

    CUDA   a ``torch.cuda.Event`` recorded on the copy stream after layer l's copies: ``wait()``
           makes the compute stream wait, the host never blocks
    CPU    a ``threading.Event`` set by whoever copies layer l (or ``LANDED``: already there)

A step can hold several sequences whose pages land; their waits for layer l are joined here.
"""
from __future__ import annotations

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


__all__ = ["AllOf", "LANDED", "join_layers", "landed"]
