"""Token ids to text deltas for a stream, with stop strings (pure, over a tokenizer); and a prompt to token ids.

Detokenizing one id at a time is wrong (byte-level BPE splits characters across tokens, and a
leading space belongs to the next token), and re-decoding everything at each step is quadratic.
So, like vLLM, decode a short window: the ids since ``prefix`` (already shown) up to now, and
show only what the window adds beyond the prefix's text, holding back a trailing U+FFFD (half a
UTF-8 character).

Stop strings: text is held back while its tail could still become a stop string; when one
appears, the text before it is released and the rest (the stop string included) never is.

    emitted ─────────────┐ held (could start "</s") ┐
    "The answer is 42.</"                           └─ released when the next delta rules it out
"""
from __future__ import annotations

from collections.abc import Sequence

from residency.events.serving import Tokenize, Tokenized


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0          # ids[:_prefix] are covered by text already produced
        self._read = 0            # ids[_prefix:_read] decode to _prefix_text
        self._held = ""           # produced, not yet released (may be the start of a stop string)
        self.stopped: str | None = None   # the stop string that ended the text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special=self.skip_special)

    def push(self, token_id: int) -> str:
        """Add one id; return the text that may be shown now ("" while held back)."""
        if self.stopped is not None:
            return ""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""             # nothing new yet, or half a character: wait for the next id
        delta = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(delta)

    def _release(self, delta: str) -> str:
        text = self._held + delta
        if not self.stop:
            self._held = ""
            return text
        cut = None
        for s in self.stop:
            i = text.find(s)
            if i != -1 and (cut is None or i < cut[0]):
                cut = (i, s)
        if cut is not None:
            self.stopped = cut[1]
            self._held = ""
            return text[:cut[0]]
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep] if keep else text

    def flush(self) -> str:
        """At the end of the stream: release what was held (it never became a stop string)."""
        if self.stopped is not None:
            return ""
        text, self._held = self._held, ""
        return text


def tokenize_prompt(msg: Tokenize, *, worker: int, tokenizer, max_positions: int, vocab_size: int, keys_fn,
                    page: int, model_digest: str) -> Tokenized:
    """Render (chat) and encode one model's prompt and make the content keys of its full pages, or
    refuse it by name (too long, empty, an id outside the vocabulary, a template that fails). Reads
    only the model's tokenizer and fixed values: the serving loop and a worker's per-model
    tokenizers (a model that is not resident, dataplane/weights_swap.py) give the same answer."""
    def refuse(error: str) -> Tokenized:
        return Tokenized(request_id=msg.request_id, worker=worker, token_ids=[], keys=[], error=error)

    ctx = max_positions
    too_long = f"context_length_exceeded: this model's context window is {ctx} tokens; the prompt is"
    try:
        if msg.messages is not None:
            text, special = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msg.messages], add_generation_prompt=True), False
        else:
            text, special = msg.prompt, True
        if text is not None:
            if tokenizer.surely_over(text, ctx):        # not worth encoding
                return refuse(f"{too_long} {len(text)} characters, more than {ctx} tokens can hold "
                              f"(none stands for over {tokenizer.max_token_bytes} bytes)")
            ids = tokenizer.encode(text, add_special=special)
        elif msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
        else:
            return refuse("empty_prompt: no messages, prompt or prompt_token_ids")
    except Exception as e:  # noqa: BLE001 - a template's raise_exception, a missing template
        name = type(e).__name__
        kind = "chat_template_missing" if name == "ChatTemplateMissing" else "invalid_messages"
        return refuse(f"{kind}: {e}")
    if not ids:
        return refuse("empty_prompt: the prompt renders to no tokens")
    if len(ids) >= ctx:        # refused here: no id checked, no content keys made, no ids sent back
        return refuse(f"{too_long} {len(ids)} tokens")
    if text is None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return refuse(f"invalid_token_id: {bad[:4]} not in [0, {vocab_size})")
    return Tokenized(request_id=msg.request_id, worker=worker, token_ids=ids,
                     keys=keys_fn(ids, page, model_digest), vocab_size=vocab_size)
