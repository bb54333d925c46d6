"""Tokenizer and chat template: rebuilt from GGUF metadata or tokenizer.json, checked against transformers."""
from __future__ import annotations

import json
import os

import pytest

from residency.dataplane.model import ChatTemplateMissing, IncrementalDecoder, load_model, random_model
from residency.dataplane.model.tokenizer import Tokenizer, tokenizer_from_hf_dir
from tests.model.conftest import TINY_LLAMA3
from tests.model.helpers_model import CHATML, write_hf_dir

TEXTS = [
    "Hello, world! How are you today?",
    "The year 2024 had 366 days; π≈3.14159 and 1e-9.",
    "  leading spaces\n\n\nnew lines\ttabs   trailing  ",
    "日本語のテキスト 🚀 émojis — and Ελληνικά",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_round_trips_text(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < smollm2.config.vocab_size for i in ids)


@pytest.mark.model
def test_gguf_tokenizer_matches_transformers_reading_the_same_gguf(smollm2):
    path = smollm2.source
    try:  # transformers' own GGUF tokenizer builder, without loading the model (~1 s, not ~20 s)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        backend, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(path)[:2])

        def encode(text):
            return backend.encode(text, add_special_tokens=False).ids
    except ImportError:  # another transformers layout: the public (slow) route
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))

        def encode(text):
            return hf.encode(text, add_special_tokens=False)
    for text in TEXTS:
        assert smollm2.tokenizer.encode(text) == encode(text), text


@pytest.mark.model
def test_special_tokens_are_whole_and_eos_ids_end_the_turn(smollm2):
    tok = smollm2.tokenizer
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.encode("a<|im_end|>b")[1] == im_end
    assert im_end in tok.eos_token_ids
    assert tok.decode(tok.encode("hi<|im_end|>"), skip_special=True) == "hi"


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_chat_template_renders_like_transformers(smollm2, add_generation_prompt, system):
    from transformers import PreTrainedTokenizerFast

    tok = smollm2.tokenizer
    msgs = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, chat_template=tok.chat_template)
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert got.count("<|im_start|>") == len(msgs) + (system is None) + add_generation_prompt
    assert tok.encode(got) == hf.encode(want, add_special_tokens=False)


def test_hf_directory_tokenizer_and_template(tmp_path):
    m = random_model(TINY_LLAMA3, seed=1)
    write_hf_dir(str(tmp_path), m)
    tok = tokenizer_from_hf_dir(str(tmp_path))
    assert tok.eos_token_ids == {0, 2}                      # generation_config list + eos_token
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert tok.decode(tok.encode("hello the world!")) == "hello the world!"
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=CHATML)
    assert tok.apply_chat_template(CONVERSATION) == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_a_model_without_template_refuses_to_render_by_name(tmp_path):
    m = random_model(TINY_LLAMA3, seed=1)
    write_hf_dir(str(tmp_path), m)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)
    tok = tokenizer_from_hf_dir(str(tmp_path))
    with pytest.raises(ChatTemplateMissing):
        tok.apply_chat_template(CONVERSATION)


def test_incremental_decoder_never_emits_half_a_character(tmp_path):
    m = random_model(TINY_LLAMA3, seed=1)
    write_hf_dir(str(tmp_path), m)
    tok: Tokenizer = load_model(str(tmp_path)).tokenizer
    text = "hello 🚀 world"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 3                            # the rocket's 4 bytes arrive one by one


@pytest.mark.model
def test_a_text_is_called_over_a_length_only_when_it_is(smollm2):
    """``surely_over`` decides without encoding; whenever it says over, the encoding is over."""
    import random
    tok = smollm2.tokenizer
    per = tok.max_token_bytes
    assert isinstance(per, int) and per >= 16
    longest = max(tok.backend.get_vocab(), key=lambda t: len(t.encode()))
    piece = tok.decode([tok.token_to_id(longest)])
    rng = random.Random()
    pieces = TEXTS + [piece, "a", " ", "🚀", "<|im_start|>", "\n", "ζ"]
    said_over = 0
    for _ in range(40):
        n = rng.randint(1, 12)
        text = "".join(rng.choice(pieces) * rng.randint(1, 200) for _ in range(rng.randint(1, 30)))
        if tok.surely_over(text, n):
            said_over += 1
            assert len(tok.encode(text)) > n, (n, len(text))
    assert said_over >= 5
    assert tok.surely_over(piece * (10 * per), 10) and len(tok.encode(piece * (10 * per))) > 10
    assert not tok.surely_over("word " * 50, 10)          # over, but not sure without encoding: False



@pytest.mark.model
def test_the_byte_level_bound_is_the_longest_tokens_own_bytes_and_exact(smollm2):
    """SmolLM2's longest token covers 81 bytes (its vocabulary string is 162 in UTF-8: the byte
    alphabet doubles what it spells): 7 of them fit in 7 tokens, one byte more is over."""
    tok = smollm2.tokenizer
    longest = max(range(tok.vocab_size), key=lambda i: len(tok.token_bytes(i)))
    piece = tok.token_bytes(longest).decode()
    assert tok.max_token_bytes == len(piece.encode()) == 81
    assert len(tok.encode(piece * 7)) == 7 and not tok.surely_over(piece * 7, 7)
    assert tok.surely_over(piece * 7 + "x", 7) and len(tok.encode(piece * 7 + "x")) > 7


def test_the_length_bound_reads_the_normalized_text_and_is_off_without_bpe():
    from tokenizers import Tokenizer as Backend, models, normalizers, pre_tokenizers
    bpe = Backend(models.BPE(vocab={"a": 0, "b": 1, " ": 2}, merges=[]))
    tok = Tokenizer(bpe, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[])
    assert tok.max_token_bytes == 1
    assert tok.surely_over(" " * 100 + "ab", 10)
    assert not tok.surely_over("a" * 10, 10) and len(tok.encode("a" * 10)) == 10     # the edge: exactly fits
    assert tok.surely_over("a" * 11, 10) and len(tok.encode("a" * 11)) == 11
    bpe.normalizer = normalizers.Strip()                  # 100 spaces stripped: 2 bytes are left
    assert not tok.surely_over(" " * 100 + "ab", 10) and len(tok.encode(" " * 100 + "ab")) <= 10
    wp = Backend(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]", max_input_chars_per_word=10**6))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    unk = Tokenizer(wp, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[])
    assert unk.max_token_bytes is None and not unk.surely_over("x" * 10_000, 3)
    assert len(unk.encode("x" * 10_000)) == 1             # one [UNK] for the whole word: no bound holds


@pytest.mark.model
def test_a_long_text_is_encoded_with_the_gil_let_go_and_to_the_same_ids(smollm2, monkeypatch):
    from residency.dataplane.model import tokenizer as tk
    tok = smollm2.tokenizer
    text = "".join(TEXTS) * (tk.LONG_TEXT_CHARS // len("".join(TEXTS)) + 1)
    expect = tok.backend.encode(text, add_special_tokens=False).ids
    batched = []
    monkeypatch.setattr(tok, "backend", _Spy(tok.backend, batched))
    assert tok.encode(text) == expect and batched == [1]
    assert tok.encode(TEXTS[0]) == tok.backend.encode(TEXTS[0]).ids and batched == [1]     # short: plain encode


class _Spy:
    """The tokenizers backend, counting encode_batch calls."""

    def __init__(self, backend, calls):
        self._b, self._calls = backend, calls

    def encode_batch(self, texts, **kw):
        self._calls.append(len(texts))
        return self._b.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self._b, name)


def _random_texts(seed: int, n: int) -> list[str]:
    import random
    rng = random.Random(seed)
    planes = [(32, 126), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x1FFFF)]
    out = []
    for _ in range(n):
        out.append("".join(chr(rng.randint(*rng.choice(planes))) for _ in range(rng.randint(1, 40))))
    return out


@pytest.mark.model
def test_the_bytes_of_a_texts_tokens_spell_its_utf8(smollm2):
    """What logprobs report per token: joined over the tokens of any text (special tokens, emoji
    cut mid-character, random code points of every plane), the text's own UTF-8."""
    tok = smollm2.tokenizer
    for text in TEXTS + _random_texts(7, 300):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), text
    assert [tok.token_bytes(i) for i in tok.encode("é🚀")][-1] != "🚀".encode()   # a piece of a character
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
    assert tok.token_bytes(10**9) == b""


def test_token_bytes_of_a_sentencepiece_vocabulary_undo_byte_tokens_and_word_marks():
    from tokenizers import Tokenizer as Backend, decoders, models
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xE2>": 2, "\u2581hi": 3, "there": 4, "<0xZZ>": 5}
    bpe = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(bpe, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[])
    assert [tok.token_bytes(i) for i in range(6)] == [b"<unk>", b"\n", b"\xe2", b" hi", b"there", b"<0xZZ>"]
