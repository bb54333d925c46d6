"""Our forward against transformers' own Llama on the same weights, in float32."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import BatchError, SeqInput, load_model, random_model
from tests.model.conftest import TINY_LLAMA3, poisoned_pool
from tests.model.helpers_model import write_hf_dir

REL = 1e-5   # fp32 vs fp32: only summation order differs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.model
def test_smollm2_prefill_and_decode_logits_match_transformers(smollm2, smollm2_hf):
    tok, runner = smollm2.tokenizer, smollm2.runner
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}]))
    ref = hf_logits(smollm2_hf, ids + [504, 3158, 28])
    pool = poisoned_pool(runner, 16, 16)
    table = [9, 3, 14, 0, 7, 11]                      # scattered, out of order
    got = runner.forward([SeqInput(ids, 0, table)], pool)[0]
    assert rel_err(got, ref[len(ids) - 1]) < REL
    for i, t in enumerate([504, 3158, 28]):           # decode path: one token over the pages
        got = runner.forward([SeqInput([t], len(ids) + i, table)], pool)[0]
        assert rel_err(got, ref[len(ids) + i]) < REL
        assert int(got.argmax()) == int(ref[len(ids) + i].argmax())


@pytest.mark.model
def test_smollm2_mixed_batch_matches_each_sequence_alone(smollm2, smollm2_hf):
    """Two prefills, a decode and a cached-prefix prefill in one step."""
    runner = smollm2.runner
    a = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    b = smollm2.tokenizer.encode("In 1969, the first humans landed on")
    pool = poisoned_pool(runner, 32, 8)
    runner.forward([SeqInput(a[:-1], 0, [1, 2, 3]), SeqInput(b[:5], 0, [10, 11])], pool)   # earlier steps
    logits = runner.forward([
        SeqInput(a[-1:], len(a) - 1, [1, 2, 3]),            # decode
        SeqInput(b[5:], 5, [10, 11]),                       # prefill over a cached prefix
        SeqInput(b, 0, [20, 21]),                           # full prefill
    ], pool)
    ra, rb = hf_logits(smollm2_hf, a)[-1], hf_logits(smollm2_hf, b)[-1]
    assert rel_err(logits[0], ra) < REL
    assert rel_err(logits[1], rb) < REL and rel_err(logits[2], rb) < REL


def test_tiny_llama3_scaled_safetensors_dir_matches_transformers_from_pretrained(tmp_path):
    """transformers reads the directory itself (config.json incl. llama3 rope_parameters, safetensors)."""
    from transformers import AutoModelForCausalLM

    write_hf_dir(str(tmp_path), random_model(TINY_LLAMA3, seed=5))
    ours = load_model(str(tmp_path))
    assert ours.config.rope_scaling == TINY_LLAMA3.rope_scaling
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, TINY_LLAMA3.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits(hf, ids)
    pool = poisoned_pool(ours.runner, 40, 16)
    table = list(range(39, 0, -2))
    got = ours.runner.forward([SeqInput(ids[:290], 0, table)], pool)[0]
    assert rel_err(got, ref[289]) < REL
    for p in range(290, 300):                          # positions well past original_max_position=64
        got = ours.runner.forward([SeqInput([ids[p]], p, table)], pool)[0]
        assert rel_err(got, ref[p]) < REL


def test_rope_scaling_changes_logits_so_the_comparison_can_fail(tmp_path):
    """Guard for the test above: the same weights without Llama-3 scaling disagree with it."""
    from residency.dataplane.model.hf_reference import build_hf_llama

    m = random_model(TINY_LLAMA3, seed=5)
    hf_unscaled = build_hf_llama(TINY_LLAMA3.replace(rope_scaling=None), m.weights)
    ids = torch.randint(0, TINY_LLAMA3.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    pool = poisoned_pool(m.runner, 16, 16)
    got = m.runner.forward([SeqInput(ids, 0, list(range(13)))], pool)[0]
    assert rel_err(got, hf_logits(hf_unscaled, ids)[-1]) > 100 * REL


@pytest.mark.parametrize("bad, match", [
    (SeqInput([1, 2], 0, []), "needs 1"),
    (SeqInput([], 0, [0]), "0 new tokens"),
    (SeqInput([1], 3, [0], context_len=5), "context_len 5"),
    (SeqInput([1], 0, [99]), "out of range"),
])
def test_malformed_sequences_are_refused_by_name(tiny_fast, bad, match):
    pool = poisoned_pool(tiny_fast.runner, 4, 16)
    with pytest.raises(BatchError, match=match):
        tiny_fast.runner.forward([bad], pool)


def test_two_tokens_writing_one_page_slot_are_refused(tiny_fast):
    pool = poisoned_pool(tiny_fast.runner, 4, 16)
    with pytest.raises(BatchError, match="also writes"):
        tiny_fast.runner.forward([SeqInput([1, 2], 0, [1]), SeqInput([3], 1, [1])], pool)


def test_a_pool_of_another_shape_or_dtype_is_refused(tiny_fast):
    r = tiny_fast.runner
    with pytest.raises(BatchError, match="does not fit"):
        r.forward([SeqInput([1], 0, [0])], torch.zeros(4, 2, 2, 16, 2, 16))
    with pytest.raises(BatchError, match="bfloat16"):
        r.forward([SeqInput([1], 0, [0])], r.allocate_kv_pool(4, 16).bfloat16())
