"""The shape of a Llama-family model, its RoPE frequencies, and shape presets.

One small frozen dataclass covers SmolLM2, Llama 2/3/3.1, Qwen2 (``attention_bias``) and Mistral:
pre-norm decoder layers (RMSNorm → GQA attention with RoPE → residual, RMSNorm → SwiGLU → residual),
a final RMSNorm and an LM head that may share the embedding matrix.

One mixture-of-experts family rides on the same shape: OLMoE (``model_type`` "olmoe", e.g.
allenai/OLMoE-1B-7B). It was chosen over Mixtral and Qwen-MoE because it differs from the dense
decoder in only two places, both local: the SwiGLU becomes ``num_experts`` SwiGLU experts of
width ``intermediate`` behind a softmax top-k router (no shared expert, as Mixtral, unlike
Qwen-MoE), and Q and K are RMS-normalised over their full width before RoPE (``qk_norm``);
no sliding window (Mixtral's configs carry one), no per-layer dense/sparse mix (Qwen-MoE's
``decoder_sparse_step``). 64 experts with top-8 also make it the harder routing case to get fast.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from residency.dataplane.model.errors import UnsupportedModel


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context.

    kind "linear": every frequency divided by ``factor``.
    kind "llama3": Llama 3.1's piecewise rule (long wavelengths divided by ``factor``, short ones
    kept, a smooth blend between), parametrised by ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position``.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def to_hf(self) -> dict[str, Any]:
        if self.kind == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position,
        }


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    attention_bias: bool = False      # Qwen2 has biases on q/k/v
    model_type: str = "llama"         # transformers' name of the family: llama, mistral, qwen2, olmoe
    num_experts: int = 0              # 0: one dense SwiGLU MLP per layer
    num_experts_per_tok: int = 0      # top-k of the router
    norm_topk_prob: bool = False      # renormalise the top-k probabilities to sum to one
    qk_norm: bool = False             # RMSNorm over the whole Q and K projections (OLMoE)
    clip_qkv: float | None = None     # clamp Q, K, V to ±clip_qkv after the norms (OLMoE option)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"{self.name}: RoPE needs an even head_dim, got {self.head_dim}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModel(f"{self.name}: num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                   f"[1, num_experts={self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert of one layer (gate, up and down): what routing a token to it reads."""
        return 3 * self.hidden * self.intermediate * torch.empty((), dtype=dtype).element_size()

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers: what a KV page costs per token."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def num_params(self) -> int:
        h, i, hd = self.hidden, self.intermediate, self.head_dim
        per_layer = h * self.qkv_rows + self.num_heads * hd * h + 2 * h
        if self.is_moe:
            per_layer += self.num_experts * (3 * h * i + h)          # experts and the router's row each
        else:
            per_layer += 3 * h * i
        if self.attention_bias:
            per_layer += self.qkv_rows
        if self.qk_norm:
            per_layer += (self.num_heads + self.num_kv_heads) * hd
        lm_head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + lm_head

    def weight_bytes_read_per_step(self, dtype: torch.dtype) -> int:
        """Bytes of weights one decode step must read: every matrix once, the embedding table
        only as the LM head (a lookup reads a few rows, which we ignore). For a MoE model this
        counts every expert: an upper bound; a batch reads only the experts it routes to."""
        elem = torch.empty((), dtype=dtype).element_size()
        return (self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.hidden)) * elem

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers config dict of the same model (``LlamaConfig``, or ``OlmoeConfig`` for
        the MoE family), for tests and the GPU bench."""
        rope: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope = self.rope_scaling.to_hf()
        rope["rope_theta"] = self.rope_theta
        moe = self.model_type == "olmoe"
        shared = {
            "model_type": "olmoe" if moe else "llama",
            "architectures": ["OlmoeForCausalLM" if moe else "LlamaForCausalLM"],
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": rope if self.rope_scaling is not None else None,
        }
        if moe:     # OlmoeConfig derives head_dim from hidden / heads (config_from_hf checks they agree)
            return {**shared, "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "norm_topk_prob": self.norm_topk_prob, "clip_qkv": self.clip_qkv,
                    "pad_token_id": None, "eos_token_id": None}
        return {**shared, "head_dim": self.head_dim}

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Shapes only: the GPU bench builds random weights of these shapes (real weights do not travel).
SMOLLM2_135M = ModelConfig(
    name="SmolLM2-135M", num_layers=30, hidden=576, num_heads=9, num_kv_heads=3, head_dim=64,
    intermediate=1536, vocab_size=49152, rope_theta=100000.0, rope_scaling=None, rms_eps=1e-5,
    max_position=8192, tie_embeddings=True,
)
LLAMA3_8B = ModelConfig(
    name="Llama-3.1-8B", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
    intermediate=14336, vocab_size=128256, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position=8192),
    rms_eps=1e-5, max_position=131072, tie_embeddings=False,
)
# allenai/OLMoE-1B-7B-0924: 6.9B parameters, 1.3B active per token (64 experts, top-8).
OLMOE_1B_7B = ModelConfig(
    name="OLMoE-1B-7B", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=16, head_dim=128,
    intermediate=1024, vocab_size=50304, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
    max_position=4096, tie_embeddings=False, model_type="olmoe", num_experts=64, num_experts_per_tok=8,
    norm_topk_prob=False, qk_norm=True,
)


def config_from_hf(hf: dict[str, Any], name: str) -> ModelConfig:
    """Our config from a Hugging Face ``config.json`` (transformers 4.x or 5.x spelling)."""
    mt = hf.get("model_type", "llama")
    if mt not in ("llama", "mistral", "qwen2", "olmoe"):
        raise UnsupportedModel(f"{name}: model_type {mt!r} is not supported (llama, mistral, qwen2, olmoe)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling: RopeScaling | None
    if kind in ("default", None):
        scaling = None
    elif kind == "linear":
        scaling = RopeScaling("linear", float(rope["factor"]))
    elif kind == "llama3":
        scaling = RopeScaling(
            "llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]),
        )
    else:
        raise UnsupportedModel(f"{name}: RoPE scaling {kind!r} (supported: default, linear, llama3)")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    moe: dict[str, Any] = {}
    if mt == "olmoe":
        head_dim = int(hf.get("head_dim") or hidden // heads)
        if head_dim * heads != hidden:
            # NOTE: OLMoE's q_norm is hidden_size wide and its k_norm (hidden/heads)·kv_heads wide:
            # both assume head_dim == hidden / heads.
            raise UnsupportedModel(f"{name}: OLMoE with head_dim {head_dim} · {heads} heads != hidden {hidden}")
        moe = dict(model_type="olmoe", num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 64))),
                   num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), qk_norm=True,
                   clip_qkv=None if hf.get("clip_qkv") is None else float(hf["clip_qkv"]))
    return ModelConfig(
        name=name,
        num_layers=int(hf["num_hidden_layers"]),
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=int(hf.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", mt == "qwen2")),
        **moe,
    )


def write_hf_config(config: ModelConfig, path: str) -> None:
    with open(path, "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, computed the way transformers does.

    ``freq_factors`` is llama.cpp's ``rope_freqs`` tensor (a GGUF's form of Llama 3 scaling):
    each frequency is divided by its factor.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:
        return inv / freq_factors.float()
    s = config.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    if s.kind != "llama3":
        raise UnsupportedModel(f"RoPE scaling kind {s.kind!r}")
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_l / s.factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def rope_tables(inv_freq: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_positions, head_dim/2], float32; rows are gathered by position.

    NOTE: a table (not cos(pos·f) per call) makes a position's rotation the same bits in every
    batch, prefill or decode: part of the runner's determinism contract.
    """
    pos = torch.arange(num_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :].float()
    return freqs.cos(), freqs.sin()
