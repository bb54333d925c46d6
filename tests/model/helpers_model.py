"""Builders for model tests: a tiny byte-level BPE vocabulary, GGUF and Hugging Face directories
written from a random model, and a naive attention to check the references against."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from residency.dataplane.model.config import rope_inv_freq
from residency.dataplane.model.loader import LoadedModel, save_hf_dir
from residency.dataplane.model.weights import to_hf_state_dict

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGE_WORDS = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld", "Ġt", "Ġth", "Ġthe"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tiny_byte_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials, the 256 byte symbols, a few merged words."""
    tokens = list(SPECIALS) + list(bytes_to_unicode().values())
    merges = []
    for w in MERGE_WORDS:
        # each merge joins a known prefix with its last piece
        for cut in range(len(w) - 1, 0, -1):
            if w[:cut] in tokens and w[cut:] in tokens:
                merges.append(f"{w[:cut]} {w[cut:]}")
                break
        tokens.append(w)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py ``permute``: what the loader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, model: LoadedModel, qtype=None) -> None:
    """Write ``model`` as llama.cpp would: Q/K permuted, Llama-3 scaling as ``rope_freqs``."""
    import gguf

    qtype = qtype or gguf.GGMLQuantizationType.F32
    c = model.config
    tokens, types, merges = tiny_byte_vocab()
    assert len(tokens) <= c.vocab_size
    tokens += [f"<unused{i}>" for i in range(c.vocab_size - len(tokens))]
    types += [4] * (c.vocab_size - len(types))
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(c.name)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden)
    w.add_feed_forward_length(c.intermediate)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    sd = to_hf_state_dict(model.weights, c)

    def put(name: str, t: torch.Tensor, quant: bool = True) -> None:
        a = t.detach().float().cpu().numpy().astype(np.float32)
        if quant and qtype != gguf.GGMLQuantizationType.F32 and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_embeddings:
        put("output.weight", sd["lm_head.weight"])
    if c.rope_scaling is not None:
        base = rope_inv_freq(c.replace(rope_scaling=None))
        put("rope_freqs.weight", base / rope_inv_freq(c), quant=False)
    for i in range(c.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], c.num_heads))
        put(b + "attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], c.num_kv_heads))
        put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_tokenizer_json(vocab_size: int) -> str:
    """A tokenizer.json (byte-level BPE over ``tiny_byte_vocab``) for a Hugging Face directory."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    tokens, types, merges = tiny_byte_vocab()
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


def write_hf_dir(path: str, model: LoadedModel) -> None:
    save_hf_dir(model, path, tokenizer_json=tiny_tokenizer_json(model.config.vocab_size))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 attention, one query row at a time: q [M, nh, hd] at ``positions`` over k/v
    [ctx, nkv, hd]; row i sees keys 0..positions[i]."""
    M, nh, hd = q.shape
    g = nh // k.shape[1]
    out = torch.empty(M, nh, hd, dtype=torch.float64)
    for i in range(M):
        p = int(positions[i]) + 1
        for h in range(nh):
            s = (k[:p, h // g].double() @ q[i, h].double()) / math.sqrt(hd)
            out[i, h] = torch.softmax(s, 0) @ v[:p, h // g].double()
    return out
