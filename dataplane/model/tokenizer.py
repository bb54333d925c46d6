"""Tokenizer and chat template, from a GGUF's metadata or a Hugging Face directory.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, merges, token types and special
ids under llama.cpp's keys, and ``tokenizer.ggml.pre`` names how text is split before BPE. We
rebuild the same byte-level BPE with the ``tokenizers`` package. The chat template is the model's
own Jinja template (GGUF ``tokenizer.chat_template`` or ``tokenizer_config.json``), rendered the
way transformers renders it (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from residency.dataplane.model.errors import ChatTemplateMissing, ModelFileError, UnsupportedModel

# Token strings that end a turn in the chat formats we know; any of them present as a special
# token of the vocabulary joins the eos set, so generation stops at the end of the model's turn.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>",
    "<|end|>", "<end_of_turn>",
)

_GPT2_SPLIT = None  # ByteLevel(use_regex=True) applies GPT-2's own regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex or None for GPT-2's, digits one by one, ignore_merges)
# (llama.cpp: src/llama-vocab.cpp, the regex_exprs of each LLAMA_VOCAB_PRE_TYPE_*)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    "default": (_GPT2_SPLIT, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False),
    "gpt2": (_GPT2_SPLIT, False, False),
    "smollm": (_GPT2_SPLIT, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False, True),
    "qwen2": (_QWEN2_SPLIT, False, False),
}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the other 68 are
    shifted to code points from 256 up, in byte order. Character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_OF_CHAR = _byte_alphabet()

# Texts longer than this are encoded with the GIL let go (``Tokenizer.encode``): ~30 ms of encoding here.
LONG_TEXT_CHARS = 1 << 16


class Tokenizer:
    """``encode``/``decode`` over a ``tokenizers.Tokenizer``, the chat template and the eos ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids: set[int] = set(int(i) for i in eos_token_ids)
        self._compiled = None
        self._max_token_bytes: int | None = None
        self._added: set[int] | None = None       # ids of added tokens (token_bytes)
        self._byte_level = False

    # ------------------------------------------------------------ length bound
    @property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for; None where no such bound holds
        (WordPiece's [UNK] can stand for a whole word of any length). Byte-level BPE: the longest
        token's own bytes (``token_bytes``: each input byte is one character of its alphabet, so a
        token covers exactly its bytes; 81 for SmolLM2). Other BPE: the longest entry in UTF-8,
        at least the bytes it covers (``▁`` is 3 bytes for one space, ``<0x0A>`` 6 for one byte)."""
        if self._max_token_bytes is None and type(self.backend.model).__name__ == "BPE":
            if self._is_byte_level():
                self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
            else:
                self._max_token_bytes = max(len(t.encode()) for t in self.backend.get_vocab(with_added_tokens=True))
        return self._max_token_bytes

    def _is_byte_level(self) -> bool:
        """Both the pre-tokenizer and the decoder are byte-level (GPT-2's byte alphabet)."""
        pre = json.loads(self.backend.to_str()).get("pre_tokenizer") or {}
        return isinstance(self.backend.decoder, decoders.ByteLevel) and '"ByteLevel"' in json.dumps(pre)

    def surely_over(self, text: str, max_tokens: int) -> bool:
        """True only when ``text`` is sure to encode to more than ``max_tokens`` tokens, decided in
        linear time without encoding it (encoding 20 MB took 19 s here, long enough for a worker
        to be declared lost). Every byte of the normalized text is covered by some token and no
        token covers more than ``max_token_bytes``. With a normalizer the bound is doubled:
        special tokens are matched before normalization, and the pieces between them are
        normalized apart, not as the whole text is here. False: not sure, encode and count."""
        per = self.max_token_bytes
        if per is None:
            return False
        norm = self.backend.normalizer
        limit = (1 if norm is None else 2) * max_tokens * per
        if norm is None:
            if 4 * len(text) <= limit:          # at most 4 UTF-8 bytes a character: cannot be over
                return False
        else:
            text = norm.normalize_str(text)
        return len(text.encode()) > limit

    # ------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are
        recognised as such; ``add_special`` adds what the model adds around a text (BOS).
        A long text goes through ``encode_batch``, which lets go of the GIL while it works
        (``encode`` keeps it: 1.2 s for 3.6 MB here, during which a worker's I/O thread could
        not answer the control's Ping); the ids are the same."""
        if len(text) > LONG_TEXT_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(idx)

    def token_bytes(self, idx: int) -> bytes:
        """The bytes of text token ``idx`` stands for on its own (what logprobs report): byte-level
        BPE's printable alphabet mapped back to bytes; SentencePiece's byte tokens (``<0x0A>``) and
        word marks (``▁``) undone; an added or special token is its own text. The bytes of a text's
        tokens, joined, are the text's UTF-8 (tested on the embedded model's vocabulary)."""
        if self._added is None:
            self._added = set(self.backend.get_added_tokens_decoder())
            self._byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        tok = self.backend.id_to_token(idx)
        if tok is None:
            return b""
        if idx in self._added:
            return tok.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in tok)
            except KeyError:
                return tok.encode()
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        return tok.replace("\u2581", " ").encode()

    # ------------------------------------------------------------ chat
    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The conversation rendered by the model's own template, as transformers renders it.

        Raises ``ChatTemplateMissing`` when the model ships none: guessing a format would make
        the model answer worse without saying so.
        """
        if not self.chat_template:
            raise ChatTemplateMissing("this model ships no chat template (GGUF tokenizer.chat_template "
                                      "or tokenizer_config.json chat_template)")
        if self._compiled is None:
            self._compiled = _jinja_env().from_string(self.chat_template)
        return self._compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


class IncrementalDecoder:
    """Text deltas for a stream of ids: holds back output while the tail is a partial UTF-8
    character (decoded as U+FFFD), so a streamed reply never shows half a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special=self.skip_special)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


# ------------------------------------------------------------ builders
def tokenizer_from_gguf(metadata: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer a GGUF describes (byte-level BPE, ``tokenizer.ggml.model == gpt2``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(
            f"GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is rebuilt from GGUF metadata; "
            "load the model from its Hugging Face directory (tokenizer.json) instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} (supported: {sorted(_PRE_TOKENIZERS)})")
    split, digits, ignore_merges = _PRE_TOKENIZERS[pre]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise ModelFileError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    # type 3 = CONTROL (special: matched whole, skipped on request), 4 = USER_DEFINED (matched whole)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == 4])

    def tok(key: str) -> str | None:
        i = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = tok("bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    eos_ids = {metadata[f"tokenizer.ggml.{k}"] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if f"tokenizer.ggml.{k}" in metadata}
    eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and types[vocab[t]] == 3}
    return Tokenizer(backend, chat_template=metadata.get("tokenizer.chat_template"),
                     bos_token=bos, eos_token=tok("eos_token_id"), eos_token_ids=eos_ids)


def tokenizer_from_hf_dir(path: str, config_json: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (``tokenizer.json`` + ``tokenizer_config.json``)."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
        raise ModelFileError(f"{path}: no tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(tj)
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen = _read_json(os.path.join(path, "generation_config.json"))
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
    bos, eos = _token_str(tcfg.get("bos_token")), _token_str(tcfg.get("eos_token"))
    eos_ids: set[int] = set()
    for src in (gen, config_json or {}):
        v = src.get("eos_token_id")
        eos_ids |= set(v) if isinstance(v, list) else ({v} if isinstance(v, int) else set())
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    for t in ([eos] if eos else []) + [t for t in END_OF_TURN_TOKENS if t in specials]:
        i = backend.token_to_id(t)
        if i is not None:
            eos_ids.add(i)
    return Tokenizer(backend, chat_template=template, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids)


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
