"""Fixtures of the model-runner tests: the embedded SmolLM2 (loaded once), its transformers twin,
tiny random Llama configs, and pools poisoned with NaN so an unwritten page can never pass."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.model import RopeScaling, SMOLLM2_135M, load_model, random_model


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread in these tests: on a shared 2-core host, OpenMP's spinning barriers
    made a 40-token prefill 10x slower whenever another process held the second core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct GGUF, fp32 on CPU (fast numerics)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return load_model(None)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' LlamaForCausalLM over the same dequantized weights."""
    from residency.dataplane.model.hf_reference import build_hf_llama

    return build_hf_llama(smollm2.config, smollm2.weights)


# A tiny Llama-3.1-shaped model: GQA 3:1, Llama-3 RoPE scaling with a short original context
# (so positions in a test cross all three frequency bands), untied LM head.
TINY_LLAMA3 = SMOLLM2_135M.replace(
    name="tiny-llama3", num_layers=3, hidden=96, num_heads=6, num_kv_heads=2, head_dim=16,
    intermediate=160, vocab_size=311, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position=64),
    max_position=4096, tie_embeddings=False,
)


@pytest.fixture
def tiny_invariant():
    return random_model(TINY_LLAMA3, seed=7, batch_invariant=True)


@pytest.fixture
def tiny_fast():
    return random_model(TINY_LLAMA3, seed=7, batch_invariant=False)


def poisoned_pool(runner, num_blocks: int, page_tokens: int) -> torch.Tensor:
    """A pool whose every byte is NaN: reading a position nobody wrote poisons the logits."""
    return runner.allocate_kv_pool(num_blocks, page_tokens).fill_(float("nan"))


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(rng.randrange(1 << 62))
