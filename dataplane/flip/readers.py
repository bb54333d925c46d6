"""Readers of the weights arena: whatever holds views of its bytes, stamped with its generation.

A minimal reader protocol of our own (the pool readers of the dial, dataplane/pools/readers.py, did
not exist when this was written; this one keeps the same words: a reader has a ``name`` and a
``gen``, refuses a layout it cannot use, and is stamped on a rebind). Rebinding is all or none:
``rebind_all`` asks every reader first and binds only if none refuses, so a refused manifest
leaves every reader where it was.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from residency.dataplane.flip.errors import ReaderRefused
from residency.dataplane.flip.image import Manifest, dtype_name


class WeightsReader(Protocol):
    name: str
    gen: int | None           # the generation it carries; None: bound to nothing

    def refusal(self, manifest: Manifest) -> str | None:
        """Why this reader cannot use ``manifest``, or None. Pure."""

    def bind(self, views: Mapping[str, torch.Tensor], gen: int) -> None:
        """Hold ``views`` and carry ``gen``. Called only after ``refusal`` said None."""

    def unbind(self) -> None:
        """Drop every view (the bytes are about to change under it); ``gen`` becomes None."""


def shape_refusal(want: Mapping[str, tuple[tuple[int, ...], str]], manifest: Manifest) -> str | None:
    got = manifest.shapes()
    missing = sorted(set(want) - set(got))
    wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
    if not missing and not wrong:
        return None
    parts = []
    if missing:
        parts.append(f"missing {missing[:4]}" + (f" (+{len(missing) - 4})" if len(missing) > 4 else ""))
    for n in wrong[:4]:
        parts.append(f"{n}: wants {want[n][0]} {want[n][1]}, manifest has {got[n][0]} {got[n][1]}")
    return "; ".join(parts)


class ParamsReader:
    """Holds the views of the tensors it names (what a model runner would read)."""

    def __init__(self, name: str, want: Mapping[str, tuple[tuple[int, ...], str]]):
        self.name = name
        self.want = dict(want)
        self.gen: int | None = None
        self.views: dict[str, torch.Tensor] = {}

    @classmethod
    def of_manifest(cls, name: str, manifest: Manifest) -> "ParamsReader":
        return cls(name, manifest.shapes())

    def refusal(self, manifest: Manifest) -> str | None:
        return shape_refusal(self.want, manifest)

    def bind(self, views: Mapping[str, torch.Tensor], gen: int) -> None:
        self.views = {n: views[n] for n in self.want}
        self.gen = gen

    def unbind(self) -> None:
        self.views = {}
        self.gen = None


class ModuleReader:
    """A torch module whose parameters become views of the arena: after ``bind`` its forward reads
    the arena's bytes, with no copy. Unbound, its parameters are empty (a forward fails loudly)."""

    def __init__(self, name: str, module: torch.nn.Module):
        self.name = name
        self.module = module
        self.want = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in module.named_parameters()}
        self.gen: int | None = None

    def refusal(self, manifest: Manifest) -> str | None:
        return shape_refusal(self.want, manifest)

    def bind(self, views: Mapping[str, torch.Tensor], gen: int) -> None:
        for n, p in self.module.named_parameters():
            p.data = views[n]
        self.gen = gen

    def unbind(self) -> None:
        for _, p in self.module.named_parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.gen = None


def rebind_all(readers: Sequence[WeightsReader], manifest: Manifest, views: Mapping[str, torch.Tensor],
               gen: int) -> dict[str, int]:
    """Stamp every reader with ``gen`` or none: raises ReaderRefused (nothing rebound) if any refuses.
    Returns the stamps, reader -> gen."""
    refusals = {r.name: why for r in readers if (why := r.refusal(manifest)) is not None}
    if refusals:
        raise ReaderRefused(gen, refusals)
    for r in readers:
        r.bind(views, gen)
    return {r.name: r.gen for r in readers}
