"""The models a serving worker was started with, and where each one's weights are.

    --model PATH                 one model, named by --served-model-name or after its file
    --model NAME=PATH (repeated) several models; the first is resident at start

Every model's weights are a flip image (dataplane/flip/model_image.py). The resident one lives in
ONE device arena sized for the largest image; the runner of each model reads the arena through
views while it is resident (``RunnerReader``) and holds empty tensors otherwise. With two or
more models, one image more lives in the pinned host slab (one image plus the rotation's ring);
with three or more, the others stay in their files and are read into the slab when a flip needs
them (checked against the checksums taken at start).

    where   "device"  in the arena, served
            "host"    in the slab (a flip to it moves no file bytes)
            "file"    only in its file
            "slept"   in the pinned sleep buffer (a level-1 sleep)
            "dropped" only in its file, after a level-2 sleep (a wake reads it back)

Models that share a worker share its KV pool: their pages must have one shape (layers, 2, page,
kv heads, head dim) and dtype, or the worker refuses to start with both shapes and byte counts.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import structlog
import torch

from residency.dataplane.flip.image import Manifest, align_up, image_checksums
from residency.dataplane.flip.model_image import RunnerReader, hollow, manifest_of, named_tensors, tied
from residency.dataplane.sizing import StartRefused

log = structlog.get_logger("dataplane.weights")
MIB = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str | None          # None: the embedded SmolLM2


def parse_model_specs(values: list[str] | str | None, served_name: str | None, model_id_for) -> list[ModelSpec]:
    """``--model`` values (repeated) as specs; [] for none. ``NAME=PATH`` names a model; a bare
    path (or "embedded") is named by ``served_name`` or ``model_id_for(path)``. A path that
    exists is never split at an "=" in it."""
    if values is None:
        return []
    values = [values] if isinstance(values, str) else list(values)
    if values in ([], [""], ["none"]):
        return []
    specs: list[ModelSpec] = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or os.path.exists(v) or not name or "/" in name:
            name, path = (served_name if len(values) == 1 and served_name else model_id_for(v)), v
        if path in ("", "none"):
            raise StartRefused(f"--model {v!r}: 'none' cannot be one of several models")
        specs.append(ModelSpec(name, None if path == "embedded" else path))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise StartRefused(f"--model names {dup} more than once; name each model (NAME=PATH)")
    return specs


def rotation_chunk_bytes(max_image_bytes: int) -> int:
    """The rotation's chunk: 1/32 of the largest image, between 1 MiB and 64 MiB (a large image
    moves in 64 MiB steps, where the link runs at its limit; a small one keeps a small ring)."""
    return int(min(64 * MIB, max(MIB, align_up(max_image_bytes // 32, 256))))


def kv_block_shape(config, page_tokens: int) -> tuple[int, ...]:
    return (config.num_layers, 2, page_tokens, config.num_kv_heads, config.head_dim)


@dataclass
class ServedWeights:
    """One model of the worker: its runner (weights hollow, or views of the arena), its image's
    layout and checksums, and where the image is now."""

    name: str
    path: str | None
    model: object                 # LoadedModel (config, tokenizer, runner, digest)
    manifest: Manifest
    reader: RunnerReader
    sums: object | None           # ImageSums once taken (None: not yet; see WeightsArena.seal)
    where: str

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    def checksum_hex(self) -> str:
        return f"{self.sums.total:016x}" if self.sums is not None else ""


def read_host(spec: ModelSpec, dtype: torch.dtype, tp=None):
    """(config, host weights, tokenizer, digest, source) of a spec (``tp``: a rank's share only)."""
    from residency.dataplane.model.loader import read_model  # noqa: PLC0415

    return read_model(spec.path, dtype, tp)


def check_layouts(models: list[tuple[str, object]], page_tokens: int, dtype: torch.dtype) -> None:
    """Refuse models whose KV pages differ in shape (they share one pool)."""
    shapes = {name: kv_block_shape(c, page_tokens) for name, c in models}
    if len(set(shapes.values())) > 1:
        size = torch.empty((), dtype=dtype).element_size()
        parts = []
        for name, s in shapes.items():
            n = 1
            for x in s:
                n *= x
            parts.append(f"{name}: {' x '.join(map(str, s))} x {size} B = {n * size} B")
        raise StartRefused("models sharing a worker share its KV pool, so their pages must have one "
                                 "shape [layers, 2, page_tokens, kv_heads, head_dim]: " + "; ".join(parts))


def build_runner(config, weights, device: str, dtype: torch.dtype, max_positions: int | None, digest: str, tok,
                 source: str, tp=None):
    """A runner whose weights are hollow (bound to the arena later) and its LoadedModel."""
    from residency.dataplane.model.loader import LoadedModel  # noqa: PLC0415
    from residency.dataplane.model.runner import ModelRunner  # noqa: PLC0415

    runner = ModelRunner(config, hollow(weights, "cpu"), device=device, dtype=dtype, max_positions=max_positions,
                         tp=tp)
    return LoadedModel(runner.config, tok, runner.w, runner, digest, source)


def pack_into(buf: torch.Tensor, manifest: Manifest, weights, base: int = 0) -> None:
    """The image's bytes at ``buf[base:]``: padding zero, every tensor at its offset."""
    buf[base: base + manifest.nbytes].zero_()
    manifest.pack(named_tensors(weights), buf, base)


def store_in_slab(slab, entry: ServedWeights, weights, offset: int):
    """Put ``entry``'s image in ``slab`` at ``offset`` (where the first flip's plan wants the
    incoming image); returns its checksums."""
    from residency.dataplane.flip.image import Image  # noqa: PLC0415

    slab.image = None
    pack_into(slab.bytes, entry.manifest, weights, offset)
    slab.image = Image(entry.name, entry.manifest, image_checksums(slab.bytes[offset: offset + entry.nbytes]))
    slab.offset = offset
    return slab.image.sums


def host_available_bytes() -> int | None:
    """The host's MemAvailable (Linux /proc/meminfo), None where it cannot be read (not measured)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_copy_bytes(mode: str, image_bytes: list[int], pinned_bytes: int, available: int | None,
                    page_round) -> tuple[int, str]:
    """Bytes of the second pinned host image a flip keeps (0: every flip runs the rotation) and
    the arithmetic why. Two models only: with three, the slab is restaged from files and "both
    images" names no fixed pair. ``pinned_bytes``: what the worker pins without the copy;
    ``available``: the host's measured free memory (None: not measured, so not kept)."""
    if mode == "off":
        return 0, "--flip-host-copies off: every flip rotates"
    if len(image_bytes) != 2:
        return 0, f"{len(image_bytes)} models: host copies are kept for two models only; every flip rotates"
    need = page_round(max(image_bytes))
    if available is None:
        return 0, "host memory not measured: every flip rotates"
    if pinned_bytes + need > available:
        return 0, (f"pinned {pinned_bytes} B + host copy {need} B = {pinned_bytes + need} B > available "
                   f"{available} B: every flip rotates")
    return need, (f"pinned {pinned_bytes} B + host copy {need} B = {pinned_bytes + need} B <= available "
                  f"{available} B: both images stay on the host, a flip copies only the incoming one")


@dataclass
class LoadedSet:
    """What ``load_models`` read: each model (runner hollow), the host weights of the first two
    (the first goes to the arena, the second to the slab), and the largest image's bytes."""

    models: list[ServedWeights]
    host: dict[str, object]
    arena_bytes: int


def load_models(specs: list[ModelSpec], device: str, dtype: torch.dtype, page_tokens: int,
                max_positions: int | None, tp=None) -> LoadedSet:
    """Read every model once (the third and later: their checksums taken, their bytes let go).
    ``tp`` (dataplane/model/tp.py TensorParallel): a group's rank reads and runs its share."""
    models: list[ServedWeights] = []
    host: dict[str, object] = {}
    configs = []
    for i, spec in enumerate(specs):
        config, weights, tok, digest, source = read_host(spec, dtype, tp)
        configs.append((spec.name, config))
        check_layouts(configs, page_tokens, dtype)
        manifest = manifest_of(weights)
        loaded = build_runner(config, weights, device, dtype, max_positions, digest, tok, source, tp)
        reader = RunnerReader(spec.name, loaded.runner, manifest, tied(weights))
        sums = None
        if i >= 2:               # only in its file: checksummed now, read again at its flip
            buf = torch.empty(manifest.nbytes, dtype=torch.uint8)
            pack_into(buf, manifest, weights)
            sums = image_checksums(buf)
            del buf
        else:
            host[spec.name] = weights
        where = ("device", "host")[i] if i < 2 else "file"
        models.append(ServedWeights(spec.name, spec.path, loaded, manifest, reader, sums, where))
        del weights
        gc.collect()
        log.info("weights_read", model=spec.name, source=source, image_bytes=manifest.nbytes, where=where)
    return LoadedSet(models, host, max(m.nbytes for m in models))


__all__ = ["ModelSpec", "ServedWeights", "LoadedSet", "StartRefused", "parse_model_specs", "load_models",
           "check_layouts", "rotation_chunk_bytes", "kv_block_shape", "pack_into", "read_host", "store_in_slab",
           "host_available_bytes", "host_copy_bytes"]
