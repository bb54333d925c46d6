"""A served model's weights as a flip image, and the model runner as a reader of the arena.

    Weights (model/weights.py)          image tensor names
    embed                               embed
    lm_head (untied only)               lm_head        a tied head is the embedding's view again
    final_norm                          final_norm
    layers[i].<field> (not None)        layers.<i>.<field>

The runner's ``Weights`` fields become views of the arena (``RunnerReader.bind``): the forward
reads the arena's bytes with no copy. Unbound, every field is an empty tensor of its dtype, so a
forward on a model whose weights left the device fails loudly instead of reading another model's
bytes. ``rope_freq_factors`` stays outside the image: it is read once, when the runner builds its
RoPE tables, and is a few hundred float32s.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from residency.dataplane.flip.image import Manifest
from residency.dataplane.flip.readers import shape_refusal
from residency.dataplane.model.weights import LayerWeights, Weights

_LAYER_FIELDS = tuple(LayerWeights.__dataclass_fields__)


def tied(w: Weights) -> bool:
    return w.lm_head is w.embed


def named_tensors(w: Weights) -> dict[str, torch.Tensor]:
    """The image's tensors by name, in the order the image lays them out (see the module table)."""
    out = {"embed": w.embed}
    if not tied(w):
        out["lm_head"] = w.lm_head
    out["final_norm"] = w.final_norm
    for i, lw in enumerate(w.layers):
        for f in _LAYER_FIELDS:
            t = getattr(lw, f)
            if t is not None:
                out[f"layers.{i}.{f}"] = t
    return out


def manifest_of(w: Weights) -> Manifest:
    return Manifest.of_tensors(named_tensors(w))


def hollow(w: Weights, device: torch.device | str) -> Weights:
    """The same structure as ``w`` (fields present, tie kept), every tensor empty on ``device``:
    what a runner holds while its weights are not in the arena. ``rope_freq_factors`` is kept."""
    def empty(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty(0, dtype=t.dtype, device=device)

    embed = empty(w.embed)
    layers = [LayerWeights(*(empty(getattr(lw, f)) for f in _LAYER_FIELDS)) for lw in w.layers]
    return Weights(embed, layers, empty(w.final_norm), embed if tied(w) else empty(w.lm_head), w.rope_freq_factors)


class RunnerReader:
    """A model runner's weights as views of the arena (``name`` "runner": one runner at a time is
    bound, the resident model's)."""

    name = "runner"

    def __init__(self, model: str, runner, manifest: Manifest, is_tied: bool):
        self.model = model
        self.runner = runner
        self.want = manifest.shapes()
        self.tied = is_tied
        self.gen: int | None = None

    def refusal(self, manifest: Manifest) -> str | None:
        return shape_refusal(self.want, manifest)

    def bind(self, views: Mapping[str, torch.Tensor], gen: int) -> None:
        w = self.runner.w
        w.embed = views["embed"]
        w.lm_head = w.embed if self.tied else views["lm_head"]
        w.final_norm = views["final_norm"]
        for i, lw in enumerate(w.layers):
            for f in _LAYER_FIELDS:
                key = f"layers.{i}.{f}"
                if key in self.want:
                    setattr(lw, f, views[key])
        self.gen = gen

    def unbind(self) -> None:
        w = self.runner.w
        dev = self.runner.device
        w.embed = torch.empty(0, dtype=w.embed.dtype, device=dev)
        w.lm_head = w.embed if self.tied else torch.empty(0, dtype=w.lm_head.dtype, device=dev)
        w.final_norm = torch.empty(0, dtype=w.final_norm.dtype, device=dev)
        for lw in w.layers:
            for f in _LAYER_FIELDS:
                t = getattr(lw, f)
                if t is not None:
                    setattr(lw, f, torch.empty(0, dtype=t.dtype, device=dev))
        self.gen = None


__all__ = ["named_tensors", "manifest_of", "hollow", "RunnerReader", "tied"]
