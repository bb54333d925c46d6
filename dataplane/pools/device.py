"""The device KV pool: ONE tensor per model, block-first (see ``layout.py`` for the picture).

    tensor : [num_blocks, num_layers, 2, page_tokens, num_kv_heads, head_dim]
    words  : tensor.view(num_blocks, block_words) as int32   (what moves and checksums see)

The model runner builds block tables from logical ids with ``slot_of`` / ``block_table`` and
reads ``tensor[slots, layer, 0|1]``. A block that a restore is still bringing in has a slot but
is not READY, so ``slot_of`` refuses it (``BlockNotReady``) until its copy completed on the
device and its checksum matched.

On a CPU-only host the same class holds the tensor in RAM: identical semantics, so everything
above it (moves, mover, tests) runs unchanged in CI.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from residency.dataplane.pools.base import BlockPool
from residency.dataplane.pools.layout import KVLayout


class DevicePool(BlockPool):
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.tensor = torch.empty(layout.pool_shape(num_blocks), dtype=layout.dtype, device=self.device)
        words = self.tensor.view(num_blocks, layout.block_numel).view(torch.int32)
        super().__init__("device", layout, words)

    def block_table(self, block_ids: Iterable[int]) -> torch.Tensor:
        """Slots of READY blocks as an int32 tensor on the pool's device (for attention kernels)."""
        return torch.tensor(self.slots_of(block_ids), dtype=torch.int32, device=self.device)

    def block_view(self, block_id: int) -> torch.Tensor:
        """The block's ``[num_layers, 2, page_tokens, num_kv_heads, head_dim]`` view (READY only)."""
        return self.tensor[self.slot_of(block_id)]
