"""Readers of the device pool: everything in a worker that holds the pool's tensor, or is sized by
its slot count, and must move to a new generation together (all of them, or the pool is torn).

    reader     what it holds                                   bound by
    mover      the move context (pool words, slot-index scratch) dataplane/rebind.MoverReader
    staging    the checksum landing row, the disk staging ring   dataplane/rebind.StagingReader
    serving    the serving loop's tensor, passed to the runner    dataplane/serving.ServingLoop
    graphs     a captured CUDA graph's pool address (bench only)  dataplane/model/graphs.DecodeGraphs

A reader has a ``name``, the generation it carries (``gen``), and ``bind(pool, gen)``: check that
the pool fits it (raise ``ReaderRefused`` naming why, changing nothing), take what it needs from
the pool, then ``pool.stamp(name, gen)``. Using a pool while any reader is behind raises
``TornPool`` (``DevicePool.check_usable``).
"""
from __future__ import annotations

from typing import Protocol

import torch

from residency.dataplane.pools.errors import ReaderRefused


class PoolReader(Protocol):
    name: str
    gen: int

    def bind(self, pool, gen: int) -> None:
        """Carry ``pool`` at generation ``gen``; raises ReaderRefused (and stays as it was)."""


def check_fits(reader: str, tensor: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    """Raise ReaderRefused unless ``tensor`` is [slots, *block_shape] of ``dtype`` on ``device``."""
    got = tuple(tensor.shape[1:])
    if tensor.dim() != len(block_shape) + 1 or got != tuple(block_shape):
        raise ReaderRefused(reader, f"pool blocks are {got}, this reader reads {tuple(block_shape)}")
    if tensor.dtype != dtype:
        raise ReaderRefused(reader, f"pool is {tensor.dtype}, this reader reads {dtype}")
    if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
        raise ReaderRefused(reader, f"pool is on {tensor.device}, this reader is on {device}")


__all__ = ["PoolReader", "check_fits"]
