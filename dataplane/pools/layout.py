"""The KV layout: one tensor per model, block-first.

    pool : [num_blocks, num_layers, 2, page_tokens, num_kv_heads, head_dim]   (bf16 | fp16 | fp32)
             │          │           │  └──────────── one page: page_tokens·kv_heads·head_dim ───┘
             │          │           └ 0 = K, 1 = V
             │          └ layer
             └ block (the unit of residency, addressed by slot on each tier)

    memory:  | block 0 ........................ | block 1 ........................ | ...
             | L0 K | L0 V | L1 K | L1 V | ...  | L0 K | L0 V | ...
             └────────── block_bytes ──────────┘

Why block-first makes both consumers fast:
  * moves: a block is ONE contiguous span of ``block_bytes``, so moving n scattered blocks is n
    long unit-stride copies (one gather kernel, or n DMAs of ≥ 2 MiB each for real models) instead
    of n × num_layers × 2 small ones (a layer-first layout copies 32 KiB pages one by one, a
    small fraction of what large copies reach);
  * attention for layer l reads ``pool[block_ids, l, 0|1]``: each page it touches is a contiguous
    ``page_tokens·kv_heads·head_dim`` run (e.g. 16·8·128·2 B = 32 KiB), which is as good for HBM
    reads as a layer-first layout; only the stride between a block's pages differs.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from residency.dataplane.pools.errors import LayoutError

KV_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    page_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_tokens", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive int, got {v!r}")
        if isinstance(self.dtype, str):
            if self.dtype not in KV_DTYPES:
                raise LayoutError(f"KVLayout.dtype {self.dtype!r} is not supported (one of {sorted(KV_DTYPES)})")
            object.__setattr__(self, "dtype", KV_DTYPES[self.dtype])
        if self.dtype not in KV_DTYPES.values():
            raise LayoutError(f"KVLayout.dtype {self.dtype} is not supported (bf16, fp16 or fp32)")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [num_layers, 2, page_tokens, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.element_bytes

    @property
    def block_words(self) -> int:
        """int32 words per block: the unit the copy and checksum kernels see.

        Always whole: the K/V axis makes block_numel even, and elements are ≥ 2 bytes.
        """
        return self.block_bytes // 4

    @property
    def page_bytes(self) -> int:
        """One (layer, K|V) page: the contiguous span attention reads."""
        return self.page_tokens * self.num_kv_heads * self.head_dim * self.element_bytes

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def digest(self) -> bytes:
        """16 bytes naming this layout; stored in disk block files so a file is never read
        back into a pool of another shape or dtype."""
        text = f"{self.num_layers}/{self.page_tokens}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()
