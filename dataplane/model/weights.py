"""Model weights in the runner's layout, from GGUF, safetensors, or random.

The runner keeps each layer's Q, K and V projections as one matrix and gate/up as another, so a
step launches one matmul where a checkpoint has three (or two):

    wqkv    [(num_heads + 2·num_kv_heads)·head_dim, hidden]    rows: Q heads | K heads | V heads
    w_gate_up [2·intermediate, hidden]                          rows: gate | up

A mixture-of-experts layer (OLMoE) has no dense MLP; its experts are stacked, as transformers
keeps them in memory and as ``kernels.moe.fused_moe`` reads them:

    router            [num_experts, hidden]
    w_experts_gate_up [num_experts, 2·intermediate, hidden]    rows of expert e: gate | up
    w_experts_down    [num_experts, hidden, intermediate]
    q_norm [num_heads·head_dim], k_norm [num_kv_heads·head_dim]
A checkpoint on disk keeps one matrix per expert (``mlp.experts.{e}.gate_proj.weight`` …); the
loader stacks them (or takes transformers' stacked names as they are).
``to_hf_state_dict`` gives transformers' names back as views (no copy), for tests and the bench.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from residency.dataplane.model.config import ModelConfig
from residency.dataplane.model.errors import ModelFileError, UnsupportedModel
from residency.dataplane.model.gguf_file import GGUFFile

if TYPE_CHECKING:
    from residency.dataplane.model.tp import Shard


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor          # [hidden]
    wqkv: torch.Tensor               # [qkv_rows, hidden]
    bqkv: torch.Tensor | None        # [qkv_rows] (Qwen2) or None
    wo: torch.Tensor                 # [hidden, num_heads·head_dim]
    mlp_norm: torch.Tensor           # [hidden]
    w_gate_up: torch.Tensor | None   # [2·intermediate, hidden]; None in a MoE layer
    w_down: torch.Tensor | None      # [hidden, intermediate]; None in a MoE layer
    q_norm: torch.Tensor | None = None             # [num_heads·head_dim] (OLMoE)
    k_norm: torch.Tensor | None = None             # [num_kv_heads·head_dim] (OLMoE)
    router: torch.Tensor | None = None             # [num_experts, hidden]
    w_experts_gate_up: torch.Tensor | None = None  # [num_experts, 2·intermediate, hidden]
    w_experts_down: torch.Tensor | None = None     # [num_experts, hidden, intermediate]


@dataclass
class Weights:
    embed: torch.Tensor              # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor         # [hidden]
    lm_head: torch.Tensor            # [vocab, hidden]; the same tensor as ``embed`` when tied
    rope_freq_factors: torch.Tensor | None = None   # GGUF ``rope_freqs`` (Llama 3 scaling), float32

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "Weights":
        def cv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        embed = cv(self.embed)
        lm_head = embed if self.lm_head is self.embed else cv(self.lm_head)
        layers = [LayerWeights(*(cv(getattr(lw, f)) for f in LayerWeights.__dataclass_fields__))
                  for lw in self.layers]
        ff = None if self.rope_freq_factors is None else self.rope_freq_factors.float()
        return Weights(embed, layers, cv(self.final_norm), lm_head, ff)

    def num_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in [self.embed, self.final_norm, self.lm_head] + [
            getattr(lw, f) for lw in self.layers for f in LayerWeights.__dataclass_fields__
        ]:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def to_hf_state_dict(w: Weights, config: ModelConfig, *, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """transformers names for the same tensors (views, no copies): ``LlamaForCausalLM``'s, or
    ``OlmoeForCausalLM``'s. MoE experts are named as transformers holds them in memory (stacked
    ``mlp.experts.gate_up_proj``), or with ``per_expert`` as a checkpoint on disk names them."""
    nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm,
          "lm_head.weight": w.lm_head}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = lw.wqkv.split([nq, nkv, nkv], dim=0)
        sd.update({
            p + "input_layernorm.weight": lw.attn_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": lw.wo,
            p + "post_attention_layernorm.weight": lw.mlp_norm,
        })
        if lw.q_norm is not None:
            sd.update({p + "self_attn.q_norm.weight": lw.q_norm, p + "self_attn.k_norm.weight": lw.k_norm})
        if lw.router is not None:
            sd[p + "mlp.gate.weight"] = lw.router
            if per_expert:
                for e in range(lw.router.shape[0]):
                    gate, up = lw.w_experts_gate_up[e].chunk(2, dim=0)
                    x = p + f"mlp.experts.{e}."
                    sd.update({x + "gate_proj.weight": gate, x + "up_proj.weight": up,
                               x + "down_proj.weight": lw.w_experts_down[e]})
            else:
                sd.update({p + "mlp.experts.gate_up_proj": lw.w_experts_gate_up,
                           p + "mlp.experts.down_proj": lw.w_experts_down})
        else:
            gate, up = lw.w_gate_up.chunk(2, dim=0)
            sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                       p + "mlp.down_proj.weight": lw.w_down})
        if lw.bqkv is not None:
            bq, bk, bv = lw.bqkv.split([nq, nkv, nkv])
            sd.update({p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                       p + "self_attn.v_proj.bias": bv})
    return sd


# ------------------------------------------------------------ GGUF
def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K rows.

    ``convert_hf_to_gguf.py`` permutes each head's rows so its RoPE can rotate adjacent pairs
    (x0,x1),(x2,x3)…; transformers rotates halves (x_i, x_{i+d/2}). Per head, GGUF row 2i+j holds
    HF row j·(d/2)+i, so we view [head, d/2, 2, …] and swap the middle axes back:

        GGUF rows  0 1 2 3 4 5 6 7        (d = 8)
        HF rows    0 4 1 5 2 6 3 7   ->   HF order 0 1 2 3 | 4 5 6 7
    """
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_gguf(f: GGUFFile, name: str) -> ModelConfig:
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise UnsupportedModel(f"{name}: GGUF architecture {arch!r} is not Llama-family (llama, mistral, qwen2)")
    a = arch

    def g(key: str, default=None):
        v = meta.get(f"{a}.{key}", default)
        if v is None:
            raise ModelFileError(f"{name}: GGUF metadata lacks {a}.{key}")
        return v

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)
    scaling = None
    stype = meta.get(f"{a}.rope.scaling.type")
    if stype == "linear":
        from residency.dataplane.model.config import RopeScaling
        scaling = RopeScaling("linear", float(g("rope.scaling.factor")))
    elif stype not in (None, "none"):
        raise UnsupportedModel(f"{name}: GGUF RoPE scaling {stype!r} (supported: none, linear, rope_freqs)")
    vocab = meta.get(f"{a}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        name=name, num_layers=int(g("block_count")), hidden=hidden, num_heads=heads,
        num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv") or heads), head_dim=head_dim,
        intermediate=int(g("feed_forward_length")), vocab_size=int(vocab),
        rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_eps=float(g("attention.layer_norm_rms_epsilon")),
        max_position=int(meta.get(f"{a}.context_length", 4096)),
        tie_embeddings="output.weight" not in f.tensors,
        attention_bias=arch == "qwen2",
    )


def weights_from_gguf(f: GGUFFile, config: ModelConfig, dtype: torch.dtype = torch.float32,
                      shard: "Shard | None" = None) -> Weights:
    """Dequantized weights in ``dtype`` (each tensor converted as it is read, so the host never
    holds the whole model in float32), Q/K rows back in transformers' order. With ``shard``, only
    that tensor-parallel rank's share is kept (each tensor is dequantized whole, then cut)."""
    def t(name: str, part=None) -> torch.Tensor:
        if name not in f.tensors:
            raise ModelFileError(f"{f.path}: missing tensor {name}")
        if part is None or shard is None:
            return f.load(name).to(dtype)
        return part(f.lazy(name)).to(dtype)      # a row split dequantizes only the rows kept

    rows, cols, vocab = (None, None, None) if shard is None else (shard.rows, shard.cols, shard.vocab)

    # llama.cpp's converter permutes Q/K for the llama and mistral architectures; qwen2 files
    # keep transformers' order (its graph uses the NEOX rotation).
    permuted = f.metadata.get("general.architecture") in ("llama", "mistral")
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        q, k = t(p + "attn_q.weight", rows), t(p + "attn_k.weight", rows)
        if permuted:        # within each head, so the rank's heads unpermute alone
            div = 1 if shard is None else shard.size
            q = unpermute_rope_rows(q, config.num_heads // div)
            k = unpermute_rope_rows(k, config.num_kv_heads // div)
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([t(p + "attn_q.bias", rows), t(p + "attn_k.bias", rows), t(p + "attn_v.bias", rows)])
        layers.append(LayerWeights(
            attn_norm=t(p + "attn_norm.weight"),
            wqkv=torch.cat([q, k, t(p + "attn_v.weight", rows)]),
            bqkv=bqkv,
            wo=t(p + "attn_output.weight", cols),
            mlp_norm=t(p + "ffn_norm.weight"),
            w_gate_up=torch.cat([t(p + "ffn_gate.weight", rows), t(p + "ffn_up.weight", rows)]),
            w_down=t(p + "ffn_down.weight", cols),
        ))
    embed = t("token_embd.weight", vocab)
    lm_head = t("output.weight", vocab) if "output.weight" in f.tensors else embed
    ff = f.load("rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None   # stays float32
    return Weights(embed, layers, t("output_norm.weight"), lm_head, ff)


# ------------------------------------------------------------ safetensors
def weights_from_safetensors(path: str, config: ModelConfig, dtype: torch.dtype = torch.float32,
                             shard: "Shard | None" = None) -> Weights:
    """Weights of a Hugging Face directory (one or several ``*.safetensors`` files). With
    ``shard``, only that tensor-parallel rank's rows or columns of each tensor are read."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFileError(f"{path}: no *.safetensors files")
    where: dict[str, str] = {}
    for fn in files:
        with safe_open(fn, framework="pt") as sf:
            for k in sf.keys():
                where[k] = fn
    handles: dict[str, object] = {}

    def t(name: str, part=None) -> torch.Tensor:
        if name not in where:
            raise ModelFileError(f"{path}: missing tensor {name}")
        fn = where[name]
        if fn not in handles:
            handles[fn] = safe_open(fn, framework="pt")
        if part is None or shard is None:
            return handles[fn].get_tensor(name).to(dtype)
        return part(handles[fn].get_slice(name)).to(dtype)     # reads only the rows/columns kept

    rows, cols, vocab = (None, None, None) if shard is None else (shard.rows, shard.cols, shard.vocab)

    def experts(p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """([E, 2I, H], [E, H, I]): stacked names as they are, else one matrix per expert stacked."""
        if p + "mlp.experts.gate_up_proj" in where:
            return t(p + "mlp.experts.gate_up_proj"), t(p + "mlp.experts.down_proj")
        x = p + "mlp.experts."
        gate_up = torch.stack([torch.cat([t(x + f"{e}.gate_proj.weight"), t(x + f"{e}.up_proj.weight")])
                               for e in range(config.num_experts)])
        down = torch.stack([t(x + f"{e}.down_proj.weight") for e in range(config.num_experts)])
        return gate_up, down

    def checked(name: str, got: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
        if tuple(got.shape) != want:
            raise ModelFileError(f"{path}: {name} has shape {tuple(got.shape)}, config.json says {want}")
        return got

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bqkv = None
        if config.attention_bias:
            bqkv = torch.cat([t(a + "q_proj.bias", rows), t(a + "k_proj.bias", rows), t(a + "v_proj.bias", rows)])
        lw = LayerWeights(
            attn_norm=t(p + "input_layernorm.weight"),
            wqkv=torch.cat([t(a + "q_proj.weight", rows), t(a + "k_proj.weight", rows),
                            t(a + "v_proj.weight", rows)]),
            bqkv=bqkv,
            wo=t(a + "o_proj.weight", cols),
            mlp_norm=t(p + "post_attention_layernorm.weight"),
            w_gate_up=None, w_down=None,
        )
        if config.qk_norm:
            lw.q_norm = t(a + "q_norm.weight")
            lw.k_norm = t(a + "k_norm.weight")
        if config.is_moe:
            E, h, inter = config.num_experts, config.hidden, config.intermediate
            lw.router = checked(p + "mlp.gate.weight", t(p + "mlp.gate.weight"), (E, h))
            gate_up, down = experts(p)
            lw.w_experts_gate_up = checked(p + "mlp.experts gate_up", gate_up, (E, 2 * inter, h))
            lw.w_experts_down = checked(p + "mlp.experts down", down, (E, h, inter))
        else:
            lw.w_gate_up = torch.cat([t(p + "mlp.gate_proj.weight", rows), t(p + "mlp.up_proj.weight", rows)])
            lw.w_down = t(p + "mlp.down_proj.weight", cols)
        layers.append(lw)
    embed = t("model.embed_tokens.weight", vocab)
    if config.tie_embeddings or "lm_head.weight" not in where:
        lm_head = embed
    else:
        lm_head = t("lm_head.weight", vocab)
    return Weights(embed, layers, t("model.norm.weight"), lm_head)


def read_hf_config(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    if not os.path.exists(fn):
        raise ModelFileError(f"{path}: no config.json")
    with open(fn) as f:
        return json.load(f)


# ------------------------------------------------------------ random
def random_weights(config: ModelConfig, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> Weights:
    """Weights of ``config``'s shape drawn on ``device``: N(0, 0.02²) matrices, norms near 1.

    Used where real weights cannot go (the GPU bench) and for tiny test models. The scale keeps
    activations finite through any depth, so logits are meaningful enough to compare.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden, config.intermediate

    def mat(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=g, device=device)).to(dtype)

    def vec(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    def layer() -> LayerWeights:
        lw = LayerWeights(
            attn_norm=norm(), wqkv=mat(config.qkv_rows, h),
            bqkv=mat(config.qkv_rows) if config.attention_bias else None,
            wo=mat(h, config.num_heads * config.head_dim), mlp_norm=norm(),
            w_gate_up=None, w_down=None,
        )
        if config.qk_norm:
            lw.q_norm = vec(config.num_heads * config.head_dim)
            lw.k_norm = vec(config.num_kv_heads * config.head_dim)
        if config.is_moe:
            # The router a little wider than the rest (0.02 · 5), so a token's top-k is decided by
            # clear margins rather than near-ties (real routers are trained to be decisive).
            lw.router = mat(config.num_experts, h) * 5
            lw.w_experts_gate_up = mat(config.num_experts, 2 * i, h)
            lw.w_experts_down = mat(config.num_experts, h, i)
        else:
            lw.w_gate_up, lw.w_down = mat(2 * i, h), mat(h, i)
        return lw

    layers = [layer() for _ in range(config.num_layers)]
    embed = mat(config.vocab_size, h)
    lm_head = embed if config.tie_embeddings else mat(config.vocab_size, h)
    return Weights(embed, layers, norm(), lm_head)
