"""The host side of flip: one pinned slab that holds one weights image plus an overshoot.

    slab  |<------------------------ capacity ------------------------>|
          |<- offset ->|<------------ image ------------>|   free      |

A rotation (rotation.py) writes the outgoing image into the slab while the incoming one leaves
it, so the slab is sized for the larger image plus the rotation's ring (``capacity_for``), once,
and registered with the worker's PinnedBudget (cudaHostRegister on CUDA, plain RAM on a CPU
host). Where the image sits (``offset``) alternates between 0 and the ring's bytes, flip after flip.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from residency.dataplane.flip.image import DEFAULT_CHUNK_BYTES, Image, Manifest, image_checksums, mismatched_chunks
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.errors import ChecksumMismatch, IntegrityError


class HostSlab:
    def __init__(self, budget: PinnedBudget, capacity_bytes: int, owner: str = "weights-slab"):
        """Registers ``capacity_bytes`` with ``budget`` first: PinnedBudgetExceeded, nothing allocated."""
        self.buf = budget.alloc(owner, (int(capacity_bytes),), torch.uint8)
        self.bytes = self.buf.tensor
        self.capacity_bytes = int(capacity_bytes)
        self.image: Image | None = None
        self.offset = 0

    @staticmethod
    def capacity_for(image_bytes: Iterable[int], chunk_bytes: int, ring_depth: int) -> int:
        """Bytes a slab needs to rotate between images of these sizes: the larger one, plus the
        ring (``ring_depth`` chunks). The asymmetry of two images is inside "the larger one"."""
        return max(image_bytes) + int(ring_depth) * int(chunk_bytes)

    # ------------------------------------------------------------ filling
    def store(self, model: str, manifest: Manifest, source: Mapping[str, torch.Tensor] | torch.Tensor,
              offset: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Image:
        """Put an image in the slab at ``offset`` (tensors by name, or its flat bytes on any device)
        and record the checksums of what landed."""
        if offset < 0 or offset + manifest.nbytes > self.capacity_bytes:
            raise ValueError(f"image of {manifest.nbytes} bytes at {offset} does not fit a slab of {self.capacity_bytes}")
        self.image = None
        dst = self.bytes[offset: offset + manifest.nbytes]
        if isinstance(source, torch.Tensor):
            if source.dtype != torch.uint8 or source.numel() != manifest.nbytes:
                raise ValueError(f"flat source must be {manifest.nbytes} uint8 bytes, got {source.dtype} {source.numel()}")
            dst.copy_(source)
        else:
            dst.zero_()             # the padding between tensors is part of the checksummed bytes
            manifest.pack(source, self.bytes, offset)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.image = Image(model, manifest, image_checksums(dst, chunk_bytes))
        self.offset = offset
        return self.image

    @classmethod
    def from_tensors(cls, budget: PinnedBudget, model: str, tensors: Mapping[str, torch.Tensor],
                     overshoot_bytes: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "HostSlab":
        manifest = Manifest.of_tensors(tensors)
        slab = cls(budget, manifest.nbytes + overshoot_bytes)
        try:
            slab.store(model, manifest, tensors, 0, chunk_bytes)
        except BaseException:
            slab.close()
            raise
        return slab

    @classmethod
    def from_safetensors(cls, budget: PinnedBudget, model: str, paths: Sequence[str],
                         overshoot_bytes: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "HostSlab":
        """An image of every tensor in ``paths`` (safetensors files, in file then name order), read
        straight into the slab."""
        from safetensors import safe_open

        specs, where = [], {}
        for p in paths:
            with safe_open(p, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    specs.append((name, tuple(sl.get_shape()), _st_dtype(sl.get_dtype())))
                    where[name] = p
        manifest = Manifest.of_specs(specs)
        slab = cls(budget, manifest.nbytes + overshoot_bytes)
        try:
            slab.bytes[: manifest.nbytes].zero_()
            views = manifest.views(slab.bytes)
            for p in paths:
                with safe_open(p, framework="pt") as f:
                    for name in f.keys():
                        views[name].copy_(f.get_tensor(name))
            slab.image = Image(model, manifest, image_checksums(slab.bytes[: manifest.nbytes], chunk_bytes))
        except BaseException:
            slab.close()
            raise
        return slab

    # ------------------------------------------------------------ queries
    def image_bytes(self) -> torch.Tensor:
        if self.image is None:
            raise IntegrityError("the slab holds no image")
        return self.bytes[self.offset: self.offset + self.image.nbytes]

    def verify(self) -> None:
        """Raise ChecksumMismatch naming the chunks whose bytes are not the image's."""
        if self.image is None:
            raise IntegrityError("the slab holds no image to verify")
        bad = mismatched_chunks(self.image.sums, image_checksums(self.image_bytes(), self.image.sums.chunk_bytes))
        if bad:
            raise ChecksumMismatch(f"host image {self.image.model}", bad)

    def check_integrity(self) -> None:
        if self.image is not None and not 0 <= self.offset <= self.offset + self.image.nbytes <= self.capacity_bytes:
            raise IntegrityError(f"slab image of {self.image.nbytes} bytes at {self.offset} overruns capacity "
                                 f"{self.capacity_bytes}")

    def close(self) -> None:
        self.image = None
        self.bytes = None
        self.buf.close()


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool}


def _st_dtype(name: str) -> torch.dtype:
    if name not in _ST_DTYPES:
        raise ValueError(f"safetensors dtype {name} is not supported by the weights slab")
    return _ST_DTYPES[name]
