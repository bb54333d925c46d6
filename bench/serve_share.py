"""What a prefix another session already computed saves: time to first token of new
conversations that open with the same long system prompt, with ``--share-prefixes`` (the default)
and with ``--no-share-prefixes --retain-prefixes 0``, against a real ``residency serve``
(SmolLM2, one CPU worker, SQLite).

    python bench/serve_share.py              # -> bench/results/serve-share-<date>-cpu.json
    python bench/serve_share.py --quick

Per server: a warm-up, one donor session's first turn (the system prompt + a question), then,
in turn, ``--reps`` each of: a new session; a request outside a session; a new session after
every session's pages were parked to host RAM (so the prefix is restored first, as the cost model
chooses); each with the same system prompt and a question of its own, streamed (TTFT from the
request to the first content token); and a request outside a session whose system prompt only an
earlier request outside a session computed (kept as a retained prefix). Servers run in the order on, off, on, off (``--rounds``),
so drift shows. Reported per case and mode: TTFT p50/min/max, and the usage's shared, restored and
computed tokens; with sharing, a new session's pages are copies of the donor's (the ledger's
RequestAdmitted says so), outside a session they are read in place. Greedy; the answers of both
modes are compared token by token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import httpx  # noqa: E402
from serve import FILLER, KEY, MODEL, ROOT, Serve  # noqa: E402

from commit import git_commit  # noqa: E402  (bench/commit.py)

# a new session; no session; a new session, every other one parked; no session, the prompt family
# held only by a retained prefix (an earlier request outside a session, --retain-prefixes)
KINDS = ("session", "none", "parked", "retained")

QUESTIONS = ["What does Residency record?", "Who reads the ledger?", "Where do parked pages go?",
             "What is a spill?", "What is a restore?", "Why replay a ledger?", "What is a tier?",
             "What does the control process do?"]


def stream(s: Serve, messages, max_tokens: int, session: str | None = None) -> dict:
    """One streamed greedy chat: TTFT, its text and usage."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    for ch in s.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"session_id": session} if session else None):
        if ch.choices and ch.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    return {"ttft_s": ttft, "text": "".join(text), "usage": usage}


def park_all(s: Serve) -> None:
    listed = httpx.get(f"{s.url}/admin/sessions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    for info in listed["data"]:       # tier is the slowest of a session's pages: some may be on the device
        if info["num_blocks"]:
            s.admin(f"/admin/sessions/{info['session_id']}/park", json={"tier": "host"})


def one_server(tmp: str, share: bool, words: int, reps: int, max_tokens: int) -> dict:
    s = Serve(tmp, *(("--share-prefixes",) if share else ("--no-share-prefixes", "--retain-prefixes", "0")))
    system = {"role": "system", "content": "You answer in one sentence. Context: " + FILLER * (words // 28)}
    rows: dict[str, list] = {k: [] for k in KINDS}
    try:
        stream(s, [{"role": "user", "content": "Hello"}], 4)                        # warm up
        stream(s, [system, {"role": "user", "content": "Hello?"}], 4, session="donor")
        other = {"role": "system", "content": "You answer in two sentences. Notes: " + FILLER * (words // 28)}
        stream(s, [other, {"role": "user", "content": "Hello?"}], 4)         # retained (nobody holds it)
        for i in range(reps):
            for j, kind in enumerate(KINDS):
                q = QUESTIONS[(len(KINDS) * i + j) % len(QUESTIONS)]
                if kind == "parked":                 # every session's pages to host RAM first
                    park_all(s)
                r = stream(s, [other if kind == "retained" else system, {"role": "user", "content": q}], max_tokens,
                           session=None if kind in ("none", "retained") else f"{kind}-{i}")
                u = r["usage"]
                rows[kind].append({"question": q, "ttft_s": r["ttft_s"], "prompt_tokens": u.prompt_tokens,
                                   "shared_tokens": u.model_extra["shared_tokens"],
                                   "restored_tokens": u.model_extra["restored_tokens"],
                                   "computed_tokens": u.model_extra["computed_tokens"],
                                   "completion_tokens": u.completion_tokens, "text": r["text"]})
    finally:
        s.stop()
    return {"share": share, "rows": rows}


def summarize(runs: list[dict], share: bool, kind: str) -> dict:
    rows = [r for run in runs if run["share"] == share for r in run["rows"][kind]]
    t = [r["ttft_s"] for r in rows]
    return {"n": len(rows), "ttft_p50_s": statistics.median(t), "ttft_min_s": min(t), "ttft_max_s": max(t),
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
            "shared_tokens_p50": statistics.median(r["shared_tokens"] for r in rows),
            "restored_tokens_p50": statistics.median(r["restored_tokens"] for r in rows),
            "computed_tokens_p50": statistics.median(r["computed_tokens"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--words", type=int, default=900, help="words of the shared system prompt")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="servers with and without sharing, alternating")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                 f"serve-share-{date.today().isoformat()}-cpu.json"))
    args = p.parse_args()
    words, reps, rounds, max_tokens = (200, 1, 1, 4) if args.quick else (args.words, args.reps, args.rounds, 8)
    out: dict = {"bench": "serve_share", "git_commit": git_commit(), "date": date.today().isoformat(), "device": "cpu",
                 "cpus": os.cpu_count(), "words": words, "reps": reps, "rounds": rounds,
                 "loadavg_start": os.getloadavg()}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for share in (True, False):
                runs.append(one_server(tmp, share, words, reps, max_tokens))
    out["runs"] = runs
    out["summary"] = {f"{'shared' if share else 'not_shared'}_{kind}": summarize(runs, share, kind)
                      for share in (True, False) for kind in KINDS}
    for kind in KINDS:
        on, off = out["summary"][f"shared_{kind}"], out["summary"][f"not_shared_{kind}"]
        out["summary"][f"ttft_speedup_{kind}"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    answers: dict[tuple, set] = {}
    for run in runs:
        for kind, rows in run["rows"].items():
            for r in rows:
                answers.setdefault((kind, r["question"]), set()).add(r["text"])
    out["summary"]["answers_identical_with_and_without_sharing"] = all(len(v) == 1 for v in answers.values())
    out["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print("| new conversation | sharing | prompt tokens | shared | of them restored | computed | TTFT p50 (min-max) |")
    print("|---|---|---|---|---|---|---|")
    label = {"session": "new session", "none": "no session", "parked": "new session, the others parked to host",
             "retained": "no session, the prefix retained from an earlier one"}
    for kind in KINDS:
        for share in (True, False):
            r = out["summary"][f"{'shared' if share else 'not_shared'}_{kind}"]
            print(f"| {label[kind]} | {'on' if share else 'off'} | "
                  f"{r['prompt_tokens']:.0f} | {r['shared_tokens_p50']:.0f} | {r['restored_tokens_p50']:.0f} | "
                  f"{r['computed_tokens_p50']:.0f} | "
                  f"{1e3 * r['ttft_p50_s']:.0f} ms ({1e3 * r['ttft_min_s']:.0f}-{1e3 * r['ttft_max_s']:.0f}) |")
    print("TTFT speedup: " + ", ".join(f"{label[k]} {out['summary'][f'ttft_speedup_{k}']:.2f}x" for k in KINDS))
    print(f"answers identical with and without sharing: {out['summary']['answers_identical_with_and_without_sharing']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
