"""transformers' own Llama (or OLMoE) over our weights: the reference the tests and the bench compare with.

transformers is a test-time dependency only; it is imported inside the function. The model is
built on the meta device and its parameters are assigned as views of our tensors (fused QKV and
gate/up split back by ``to_hf_state_dict``), so the reference costs no second copy of the weights.
"""
from __future__ import annotations

import torch

from residency.dataplane.model.config import ModelConfig
from residency.dataplane.model.weights import Weights, to_hf_state_dict


def build_hf_llama(config: ModelConfig, weights: Weights, attn_implementation: str = "sdpa"):
    """transformers' ``LlamaForCausalLM``, or ``OlmoeForCausalLM`` for an OLMoE config."""
    if config.model_type == "olmoe":
        from transformers import OlmoeConfig as HFConfig, OlmoeForCausalLM as HFModel
    else:
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM as HFModel

    device = weights.embed.device
    hf_cfg = HFConfig(**config.to_hf_dict())
    hf_cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = HFModel(hf_cfg)
    sd = to_hf_state_dict(weights, config)
    if config.tie_embeddings:
        sd.pop("lm_head.weight")
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE inv_freq) were never loaded: rebuild those modules for real.
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(hf_cfg).to(device))
    if config.rope_scaling is None and weights.rope_freq_factors is not None:
        raise NotImplementedError("GGUF rope_freqs factors have no transformers config equivalent")
    # Device only: a dtype cast would also turn the float32 RoPE inv_freq buffer into bf16, which
    # transformers' own bf16 loading keeps in float32.
    return model.to(device=device).eval()
