"""A weights image: named tensors laid out in one flat byte range, with checksums of its bytes.

    image bytes  |<-- embed -->|pad|<-- q_proj -->|pad| ... |<-- lm_head -->|pad|
    offsets       0             256·k               ...                      nbytes (a multiple of 256)
    chunks       |<- chunk 0 ->|<- chunk 1 ->| ... |<- last (may be short) ->|

``Manifest`` is the layout only (name, shape, dtype, offset, nbytes per tensor, in order); two
images with equal manifests are interchangeable to every reader (a refit of the same model).
``ImageSums`` is what the bytes were when the image was made: psum64 (kernels/checksum.py) of each
chunk, salted with the chunk's index so two swapped chunks do not verify, and one checksum over
the chunk checksums. The same function runs on the GPU (Triton) and on the CPU (its torch
reference); kernels/checksum.py's tests hold the two equal, so an image checked on one verifies
on the other.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from residency.kernels.checksum import block_checksums, checksums_to_ints

ALIGN_BYTES = 256
DEFAULT_CHUNK_BYTES = 64 << 20
# the salt of the checksum over the chunk checksums: outside any chunk index an image can have
_TOTAL_ID = 1 << 62


def align_up(n: int, to: int = ALIGN_BYTES) -> int:
    return -(-int(n) // to) * to


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """The ordered layout of an image. ``nbytes`` includes the padding after the last tensor."""

    entries: tuple[TensorEntry, ...]
    nbytes: int

    @classmethod
    def of_specs(cls, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> "Manifest":
        entries, off, seen = [], 0, set()
        for name, shape, dtype in specs:
            if name in seen:
                raise ValueError(f"tensor {name!r} named twice in one image")
            seen.add(name)
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            entries.append(TensorEntry(name, tuple(int(s) for s in shape), dtype_name(dtype), off, nbytes))
            off = align_up(off + nbytes)
        return cls(tuple(entries), off)

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> "Manifest":
        return cls.of_specs((n, tuple(t.shape), t.dtype) for n, t in tensors.items())

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {e.name: (e.shape, e.dtype) for e in self.entries}

    def views(self, buf: torch.Tensor, base: int = 0) -> dict[str, torch.Tensor]:
        """Each tensor as a view of the uint8 buffer ``buf`` starting at byte ``base``."""
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"views need a flat uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
        if base + self.nbytes > buf.numel():
            raise ValueError(f"manifest of {self.nbytes} bytes at {base} overruns a buffer of {buf.numel()}")
        out = {}
        for e in self.entries:
            raw = buf[base + e.offset: base + e.offset + e.nbytes]
            out[e.name] = raw.view(dtype_of(e.dtype)).view(e.shape)
        return out

    def pack(self, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor, base: int = 0) -> None:
        """Copy ``tensors`` (any device) into their places in ``buf``; refuses a set that does not match."""
        want = self.shapes()
        got = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()}
        if want != got:
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
            raise ValueError(f"tensors do not match the manifest: missing {missing}, extra {extra}, wrong shape {wrong}")
        views = self.views(buf, base)
        for n, t in tensors.items():
            views[n].copy_(t)


@dataclass(frozen=True)
class ImageSums:
    chunk_bytes: int
    chunks: tuple[int, ...]
    total: int


@dataclass(frozen=True)
class Image:
    """What a buffer holds: which model, its layout, and the checksums its bytes must match
    (None: not taken yet; an image is checksummed before it first leaves the buffer it was
    written to, e.g. a served model at its first sleep)."""

    model: str
    manifest: Manifest
    sums: ImageSums | None

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes


def image_checksums(data: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ImageSums:
    """psum64 of each ``chunk_bytes`` chunk of the flat uint8 ``data`` (the last may be short) and
    of the chunk checksums. On a GPU for device bytes, and for pinned host bytes when CUDA is up
    (the kernel reads the mapped pages over the link); else the torch reference on the CPU."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"image_checksums needs flat uint8 bytes, got {data.dtype} {tuple(data.shape)}")
    n = data.numel()
    if n % 4 or chunk_bytes <= 0 or chunk_bytes % 4:
        raise ValueError(f"image bytes ({n}) and chunk_bytes ({chunk_bytes}) must be multiples of 4 and > 0")
    on = data.device
    if not data.is_cuda and torch.cuda.is_available() and data.is_pinned():
        on = torch.device("cuda", torch.cuda.current_device())
    full, tail = divmod(n, chunk_bytes)
    sums: list[int] = []
    if full:
        rows = data[: full * chunk_bytes].view(torch.int32).view(full, chunk_bytes // 4)
        idx = torch.arange(full, dtype=torch.int64, device=on)
        sums += checksums_to_ints(block_checksums(rows, idx, idx))
    if tail:
        row = data[full * chunk_bytes:].view(torch.int32).view(1, tail // 4)
        idx = torch.tensor([full], dtype=torch.int64, device=on)
        sums += checksums_to_ints(block_checksums(row, torch.zeros(1, dtype=torch.int64, device=on), idx))
    words = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in sums] or [0], dtype=torch.int64)
    total = checksums_to_ints(block_checksums(words.view(torch.int32).view(1, -1), [0], [_TOTAL_ID]))[0]
    return ImageSums(int(chunk_bytes), tuple(sums), total)


def mismatched_chunks(expected: ImageSums, got: ImageSums) -> list[tuple[int, int, int]]:
    """(chunk, expected, got) for every chunk that differs (a length change counts as every chunk)."""
    if len(expected.chunks) != len(got.chunks) or expected.chunk_bytes != got.chunk_bytes:
        return [(-1, expected.total, got.total)]
    return [(i, e, g) for i, (e, g) in enumerate(zip(expected.chunks, got.chunks)) if e != g]
