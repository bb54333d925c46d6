"""An OLMoE-family model: loaded from a Hugging Face directory and run by our runner, against
transformers' own ``OlmoeForCausalLM`` reading the same directory, in float32 on the CPU."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from residency.dataplane.model import (
    ModelFileError,
    SamplingParams,
    SeqInput,
    UnsupportedModel,
    generate,
    load_model,
    random_model,
)
from residency.dataplane.model.config import OLMOE_1B_7B, config_from_hf
from tests.model.conftest import poisoned_pool
from tests.model.helpers_model import write_hf_dir

REL = 1e-5

# OLMoE's layout at a size a CPU test runs in a second: 16 experts, top-4, MHA with q/k norm.
TINY_OLMOE = OLMOE_1B_7B.replace(
    name="tiny-olmoe", num_layers=3, hidden=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate=48,
    vocab_size=311, num_experts=16, num_experts_per_tok=4, max_position=1024,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def olmoe_dir(tmp_path, rng):
    path = str(tmp_path / "tiny-olmoe")
    model = random_model(TINY_OLMOE, seed=rng.randrange(1 << 30))
    write_hf_dir(path, model)
    return path, model


def hf_from_dir(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_olmoe_directory_loads_and_matches_transformers_from_pretrained(olmoe_dir, gen):
    """transformers reads the directory itself (per-expert checkpoint names, q/k norms), so the
    files are the real family's format, not only ours."""
    path, _ = olmoe_dir
    ours = load_model(path)
    assert ours.config.is_moe and ours.config.qk_norm and ours.config.model_type == "olmoe"
    hf = hf_from_dir(path)
    assert type(hf).__name__ == "OlmoeForCausalLM"
    ids = torch.randint(0, TINY_OLMOE.vocab_size, (45,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    pool = poisoned_pool(ours.runner, 12, 8)
    table = [11, 2, 7, 0, 5, 9, 3]
    got = ours.runner.forward([SeqInput(ids[:40], 0, table)], pool)[0]
    assert rel_err(got, ref[39]) < REL
    for p in range(40, 45):                          # decode path over the pages
        got = ours.runner.forward([SeqInput([ids[p]], p, table)], pool)[0]
        assert rel_err(got, ref[p]) < REL


def test_olmoe_greedy_generation_equals_transformers_generate(olmoe_dir, gen):
    path, _ = olmoe_dir
    ours = load_model(path)
    hf = hf_from_dir(path)
    for n in (1, 13):                                # a one-token prompt and a longer one
        ids = torch.randint(3, TINY_OLMOE.vocab_size, (n,), generator=gen).tolist()
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        got = generate(ours, [ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
        assert got == want


def test_olmoe_saved_by_transformers_or_with_stacked_experts_loads_the_same(olmoe_dir, tmp_path, gen):
    """Whatever names transformers' own save_pretrained writes for the experts, we read them; and
    a file holding the experts stacked (transformers' in-memory names) too."""
    from safetensors.torch import save_file

    from residency.dataplane.model.weights import to_hf_state_dict

    path, model = olmoe_dir
    resaved, stacked = str(tmp_path / "resaved"), str(tmp_path / "stacked")
    hf_from_dir(path).save_pretrained(resaved)
    os.makedirs(stacked)
    sd = to_hf_state_dict(model.weights, model.config)
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(stacked, "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), stacked)
    for out in (resaved, stacked):
        shutil.copy(os.path.join(path, "tokenizer.json"), out)
    ids = torch.randint(0, TINY_OLMOE.vocab_size, (9,), generator=gen).tolist()

    def logits(p: str) -> torch.Tensor:
        m = load_model(p)
        return m.runner.forward([SeqInput(ids, 0, [0, 1])], poisoned_pool(m.runner, 2, 8))

    want = logits(path)
    assert torch.equal(logits(resaved), want)
    assert torch.equal(logits(stacked), want)


def test_qk_norm_and_routing_change_the_logits_so_the_comparison_can_fail(gen):
    m = random_model(TINY_OLMOE, seed=3)
    ids = torch.randint(0, TINY_OLMOE.vocab_size, (12,), generator=gen).tolist()

    def logits(model):
        return model.runner.forward([SeqInput(ids, 0, [0, 1])], poisoned_pool(model.runner, 2, 8))[0]

    base = logits(m)
    for field in ("q_norm", "router"):
        other = random_model(TINY_OLMOE, seed=3)
        t = getattr(other.runner.w.layers[1], field)
        t.copy_(torch.flip(t, dims=[0]))
        assert rel_err(logits(other), base) > 1e-3, field


def test_olmoe_batch_invariant_runner_gives_a_sequence_the_same_bits_alone_and_batched(gen):
    m = random_model(TINY_OLMOE, seed=4, batch_invariant=True)
    a = torch.randint(0, TINY_OLMOE.vocab_size, (21,), generator=gen).tolist()
    b = torch.randint(0, TINY_OLMOE.vocab_size, (6,), generator=gen).tolist()
    pool = poisoned_pool(m.runner, 10, 8)
    alone = m.runner.forward([SeqInput(a, 0, [0, 1, 2])], pool)[0]
    both = m.runner.forward([SeqInput(b, 0, [5]), SeqInput(a, 0, [6, 7, 8])], pool)[1]
    assert torch.equal(alone, both)


def test_olmoe_directory_with_a_missing_expert_is_refused_by_name(olmoe_dir):
    from safetensors.torch import load_file, save_file

    path, _ = olmoe_dir
    fn = os.path.join(path, "model.safetensors")
    sd = load_file(fn)
    del sd["model.layers.2.mlp.experts.7.up_proj.weight"]
    save_file(sd, fn)
    with pytest.raises(ModelFileError, match="model.layers.2.mlp.experts.7.up_proj.weight"):
        load_model(path)


def test_olmoe_config_whose_norm_widths_do_not_fit_is_refused():
    hf = json.loads(json.dumps(TINY_OLMOE.to_hf_dict()))
    assert config_from_hf(hf, "ok").num_experts == 16
    hf["head_dim"] = 32
    with pytest.raises(UnsupportedModel, match="head_dim 32"):
        config_from_hf(hf, "bad")
    hf = TINY_OLMOE.to_hf_dict() | {"num_experts_per_tok": 17}
    with pytest.raises(UnsupportedModel, match="num_experts_per_tok=17"):
        config_from_hf(hf, "bad")
