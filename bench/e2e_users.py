"""The load of bench/serve_e2e.py: simulated users holding multi-turn conversations, in the
manner of vLLM's ``benchmark_serving`` but closed-loop (each user waits for its answer, thinks,
and sends its next turn), and the figures drawn from what they saw.

A user's conversation: the shared system prompt, then ``turns`` user messages of
``turn_tokens`` each, every one sent with the whole history (the model's earlier answers
included) under the user's own session id, streamed with ``ignore_eos`` so every answer is
``max_tokens`` long. Between turns the user thinks ``think_s`` (±10%): longer than the server's
``--park-after-s``, so its session is parked and the next turn finds its prefix off the device.
A conversation ends at ``turns`` or when the next prompt would pass ``max_history`` tokens.

Every request yields one ``Turn`` record; none is retried. A failure is any answer that is not a
200 stream ending in ``[DONE]`` without an error event, or no answer within the client timeout.
"""
from __future__ import annotations

import math
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
from sse_chunks import SseChunks


@dataclass
class Turn:
    user: int
    turn: int                        # 0: the conversation's first turn; > 0: a returning turn
    sent_ns: int                     # wall clock (time.time_ns), to match the ledger's ts_ns
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None      # request sent -> first content chunk
    last_token_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)    # between successive content chunks
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    restored_tokens: int | None = None
    computed_tokens: int | None = None
    cached_tokens: int | None = None
    shared_tokens: int | None = None


@dataclass
class Load:
    url: str
    model: str
    system: str
    turn_texts: list[list[str]]      # per user, its user messages
    max_tokens: int
    turn_tokens: int
    max_history: int
    think_s: float
    timeout_s: float
    session_prefix: str
    seed: int


def run_level(load: Load, concurrency: int) -> tuple[list[Turn], float]:
    """``concurrency`` users at once, each one conversation; returns every turn and the wall time."""
    out: list[Turn] = []
    lock = threading.Lock()

    def user(i: int) -> None:
        rng = random.Random(load.seed * 1000 + i)
        time.sleep(rng.uniform(0, 0.2))                  # not all in the same millisecond
        turns = _conversation(load, i, rng)
        with lock:
            out.extend(turns)

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out, key=lambda t: (t.user, t.turn)), time.monotonic() - t0


def _conversation(load: Load, user: int, rng: random.Random) -> list[Turn]:
    sid = f"{load.session_prefix}-u{user}"
    messages = [{"role": "system", "content": load.system}]
    turns: list[Turn] = []
    with httpx.Client(timeout=httpx.Timeout(load.timeout_s, connect=10.0)) as http:
        for k, text in enumerate(load.turn_texts[user]):
            if turns and (turns[-1].prompt_tokens or 0) + load.max_tokens + load.turn_tokens + 16 > load.max_history:
                break                                     # the next prompt would pass max_history
            messages.append({"role": "user", "content": text})
            t = Turn(user=user, turn=k, sent_ns=time.time_ns())
            reply = _stream(http, load, sid, messages, t)
            turns.append(t)
            if not t.ok:
                break                                     # the server's view of the history is unknown now
            messages.append({"role": "assistant", "content": reply})
            if k + 1 < len(load.turn_texts[user]):
                time.sleep(load.think_s * rng.uniform(0.9, 1.1))
    return turns


def _stream(http: httpx.Client, load: Load, sid: str, messages: list, t: Turn) -> str:
    body = {"model": load.model, "messages": messages, "max_tokens": load.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    t0 = time.perf_counter()
    prev = None
    done = False
    try:
        with http.stream("POST", load.url + "/v1/chat/completions", json=body,
                         headers={"X-Session-Id": sid}) as r:
            if r.status_code != 200:
                r.read()
                t.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return ""
            chunks = SseChunks(r.iter_lines())
            for chunk in chunks:
                if chunk.get("error"):
                    t.error = f"error event: {str(chunk['error'])[:200]}"
                    return ""
                if chunk.get("usage"):
                    u = chunk["usage"]
                    t.prompt_tokens, t.completion_tokens = u.get("prompt_tokens"), u.get("completion_tokens")
                    t.restored_tokens, t.computed_tokens = u.get("restored_tokens"), u.get("computed_tokens")
                    t.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                    t.shared_tokens = u.get("shared_tokens")
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if prev is None:
                            t.ttft_s = now - t0
                        else:
                            t.gaps_s.append(now - prev)
                        prev = now
                        text.append(piece)
            done = chunks.done
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {str(e)[:200]}"
        return ""
    if not done:
        t.error = "the stream ended without [DONE]"
    elif t.ttft_s is None:
        t.error = "no content chunk"
    else:
        t.ok = True
        t.last_token_s = prev - t0
    return "".join(text)


# ------------------------------------------------------------------ figures
def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank); None for no values (not measured, never 0)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [a, b] intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(turns: list[Turn], wall_s: float) -> dict:
    """The per-level figures of the table (times in ms).

    ``output_tok_s``: completion tokens of successful turns / the level's wall time (think time
    included, as vLLM's output throughput). ``decode_tok_s``: tokens after each turn's first /
    the time during which at least one stream was between its first and last token, and
    ``decode_streams_mean`` how many streams were in that phase on average over that time: the
    served counterpart of the runner's decode throughput at a batch of that size."""
    ok = [t for t in turns if t.ok]
    first = [t.ttft_s * 1e3 for t in ok if t.turn == 0]
    back = [t.ttft_s * 1e3 for t in ok if t.turn > 0]
    gaps = [g * 1e3 for t in ok for g in t.gaps_s]
    spans = [(t.sent_ns / 1e9 + t.ttft_s, t.sent_ns / 1e9 + t.last_token_s) for t in ok
             if t.last_token_s is not None and t.last_token_s > t.ttft_s]
    busy = union_s(spans)
    decode_tokens = sum((t.completion_tokens or 0) - 1 for t in ok if t.completion_tokens)
    longest = max((t.prompt_tokens or 0 for t in ok if t.turn > 0), default=0)
    at_longest = [t.ttft_s * 1e3 for t in ok if t.turn > 0 and (t.prompt_tokens or 0) >= 0.9 * longest]
    return {
        "requests": len(turns), "requests_failed": len(turns) - len(ok),
        "failures": [t.error for t in turns if not t.ok][:5],
        "first_turns": len(first), "returning_turns": len(back), "wall_s": wall_s,
        "output_tokens": sum(t.completion_tokens or 0 for t in ok),
        "output_tok_s": sum(t.completion_tokens or 0 for t in ok) / wall_s if wall_s > 0 else None,
        "decode_tok_s": decode_tokens / busy if busy > 0 else None,
        "decode_streams_mean": sum(b - a for a, b in spans) / busy if busy > 0 else None,
        "ttft_first_ms_p50": pct(first, 50), "ttft_first_ms_p99": pct(first, 99),
        "ttft_returning_ms_p50": pct(back, 50), "ttft_returning_ms_p99": pct(back, 99),
        "returning_longest_prompt_tokens": longest or None,
        "ttft_returning_longest_ms_p50": pct(at_longest, 50),
        "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99),
        "prompt_tokens": sum(t.prompt_tokens or 0 for t in ok),
        "prompt_tokens_restored": sum(t.restored_tokens or 0 for t in ok),
        "prompt_tokens_computed": sum(t.computed_tokens or 0 for t in ok),
        "prompt_tokens_cached": sum(t.cached_tokens or 0 for t in ok),
        "prompt_tokens_mean_returning": statistics.mean([t.prompt_tokens or 0 for t in ok if t.turn > 0])
        if back else None,
    }


def as_rows(turns: list[Turn]) -> list[dict]:
    """Each turn for the JSON, its gaps reduced to their count and median (the JSON stays small)."""
    rows = []
    for t in turns:
        d = asdict(t)
        gaps = d.pop("gaps_s")
        d["num_gaps"] = len(gaps)
        d["gap_ms_p50"] = pct([g * 1e3 for g in gaps], 50)
        rows.append(d)
    return rows
