"""GGUF reading: header parsing, dequantization, llama.cpp's Q/K permutation, config mapping."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from residency.dataplane.model import SMOLLM2_135M, UnsupportedModel, load_model
from residency.dataplane.model.gguf_file import GGUFFile
from residency.dataplane.model.hf_reference import build_hf_llama
from residency.dataplane.model.weights import unpermute_rope_rows
from tests.model.conftest import TINY_LLAMA3
from tests.model.helpers_model import llama_cpp_permute, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16])
def test_torch_dequantizers_match_the_gguf_package(tmp_path, qtype, gen):
    data = (torch.randn(48, 96, generator=gen) * 3).numpy()
    w = gguf.GGUFWriter(tmp_path / "q.gguf", "llama")
    w.add_tensor("t", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = GGUFFile(str(tmp_path / "q.gguf"))
    ours = f.load("t")
    theirs = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
    assert ours.shape == (48, 96)
    assert torch.equal(ours, torch.from_numpy(np.asarray(theirs, dtype=np.float32)))
    ref = torch.from_numpy(data)
    assert (ours - ref).norm() / ref.norm() < 0.15                   # and it is the data, roughly


def test_reader_reads_every_value_type_the_writer_writes(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    w.add_uint32("a.u32", 7); w.add_int32("a.i32", -3); w.add_float32("a.f32", 0.25)
    w.add_bool("a.b", True); w.add_string("a.s", "héllo"); w.add_uint64("a.u64", 2**40)
    w.add_array("a.arr_i", [1, 2, 3]); w.add_array("a.arr_s", ["x", "yz", ""])
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = GGUFFile(str(tmp_path / "m.gguf"))
    m = f.metadata
    assert (m["a.u32"], m["a.i32"], m["a.f32"], m["a.b"], m["a.s"], m["a.u64"]) == (7, -3, 0.25, True, "héllo", 2**40)
    assert m["a.arr_i"] == [1, 2, 3] and m["a.arr_s"] == ["x", "yz", ""]
    assert torch.equal(f.load("w"), torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_unpermute_undoes_llama_cpp_permutation(gen):
    for n_head, d in [(9, 64), (3, 64), (2, 16)]:
        w = torch.randn(n_head * d, 40, generator=gen)
        assert torch.equal(unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
        assert not torch.equal(llama_cpp_permute(w, n_head), w)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_gguf_written_like_llama_cpp_loads_to_transformers_logits(tmp_path, qtype):
    """Permuted Q/K, Llama-3 scaling stored as rope_freqs, untied head: the loader undoes it all."""
    src = load_model_random()
    write_gguf(str(tmp_path / "tiny.gguf"), src, qtype)
    m = load_model(str(tmp_path / "tiny.gguf"))
    assert m.config.num_kv_heads == 2 and not m.config.tie_embeddings
    assert m.weights.rope_freq_factors is not None
    ids = torch.randint(0, m.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))
    pool = m.runner.allocate_kv_pool(16, 16).fill_(float("nan"))
    ours = m.runner.forward([_seq(ids[0].tolist())], pool)[0]
    # the reference is transformers on the ORIGINAL weights, never on what we read back
    hf = build_hf_llama(src.config, src.weights)
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    for got, want in zip(m.weights.layers, src.weights.layers):
        step = want.wqkv.abs().max() / 127                       # Q8_0's worst rounding, roughly
        assert (got.wqkv - want.wqkv).abs().max() <= (0 if qtype == Q.F32 else step)
    assert (ours - ref).norm() / ref.norm() < (1e-5 if qtype == Q.F32 else 2e-2)


def test_unknown_gguf_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModel, match="mamba"):
        load_model(str(tmp_path / "x.gguf"))


@pytest.mark.model
def test_embedded_smollm2_has_the_preset_shape(smollm2):
    c, p = smollm2.config, SMOLLM2_135M
    assert (c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate, c.vocab_size) == (
        p.num_layers, p.hidden, p.num_heads, p.num_kv_heads, p.head_dim, p.intermediate, p.vocab_size)
    assert c.tie_embeddings and smollm2.weights.lm_head is smollm2.weights.embed
    assert c.rope_theta == p.rope_theta


# ------------------------------------------------------------------ helpers
def load_model_random():
    from residency.dataplane.model import random_model

    return random_model(TINY_LLAMA3, seed=11)


def _seq(ids):
    from residency.dataplane.model import SeqInput

    return SeqInput(ids, 0, list(range(16)))
