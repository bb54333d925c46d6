"""Token ids to text deltas for a stream, with stop strings. Pure (over a tokenizer).

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
