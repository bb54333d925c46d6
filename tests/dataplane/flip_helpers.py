"""Random weights images for the flip tests: fresh random bytes, never zeros, irregular shapes."""
from __future__ import annotations

import torch

from residency.dataplane.flip.image import Manifest


def random_tensors(seed: int, specs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in specs:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out[name] = raw.view(dtype).view(shape).clone()
    return out


def model_specs(prefix: str, layers: int, hidden: int, extra: int = 0):
    """A small Llama-like list of tensors: an embedding, per layer a projection and a norm."""
    specs = [(f"{prefix}.embed", (37 + extra, hidden), torch.bfloat16)]
    for i in range(layers):
        specs.append((f"{prefix}.layers.{i}.proj", (hidden, hidden + 3), torch.bfloat16))
        specs.append((f"{prefix}.layers.{i}.norm", (hidden,), torch.float32))
    return specs


def image_of(seed: int, prefix: str, layers: int, hidden: int, extra: int = 0):
    tensors = random_tensors(seed, model_specs(prefix, layers, hidden, extra))
    return tensors, Manifest.of_tensors(tensors)


def packed(manifest: Manifest, tensors) -> torch.Tensor:
    """The image's expected bytes: tensors at their offsets, padding zero (as the slab stores it)."""
    buf = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    manifest.pack(tensors, buf)
    return buf


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes read as floats hold NaNs, which torch.equal never calls equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
