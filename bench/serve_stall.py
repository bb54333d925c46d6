"""Does one client's huge prompt stall everyone else's stream? Inter-token gaps of a running stream
while other clients send prompts too long for the context (but not so long that they are refused
unencoded: they must be tokenized to be refused).

    python bench/serve_stall.py                  # -> bench/results/serve-stall-<date>-cpu.json
    python bench/serve_stall.py --quick

One ``residency serve`` (one CPU worker, SQLite ledger). A stream of ``--tokens`` tokens runs; once it
has produced 20 tokens, ``--huge`` requests of ``--huge-chars`` characters each are sent one after
another (each answered 400 ``context_length_exceeded`` after it is encoded). Reported: the stream's
inter-token gaps before the first huge request and while they were being refused (p50, p99, max),
and how long each refusal took.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import MODEL, ROOT, Serve  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def gaps_ms(times: list[float], lo: float, hi: float) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(times, times[1:]) if lo <= b <= hi]


def summary(gs: list[float]) -> dict:
    if not gs:
        return {"n": 0}
    return {"n": len(gs), "p50_ms": statistics.median(gs), "p99_ms": pct(gs, 0.99), "max_ms": max(gs)}


def run(s: Serve, tokens: int, huge: int, chars: int) -> dict:
    times: list[float] = []
    started = threading.Event()
    window: list[float] = []
    refusals: list[dict] = []
    text = ("hello world " * (chars // 12 + 1))[:chars]

    def hammer() -> None:
        started.wait(300)
        window.append(time.perf_counter())
        with httpx.Client(timeout=300) as c:
            for _ in range(huge):
                t0 = time.perf_counter()
                r = c.post(f"{s.url}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]})
                refusals.append({"status": r.status_code, "s": time.perf_counter() - t0,
                                 "code": (r.json().get("error") or {}).get("code")})
        window.append(time.perf_counter())

    th = threading.Thread(target=hammer)
    th.start()
    stream = s.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon who learns to cook."}],
        max_tokens=tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter())
            if len(times) == 20:
                started.set()
    started.set()
    th.join()
    lo, hi = window if len(window) == 2 else (times[-1], times[-1])
    return {"tokens": len(times), "before": summary(gaps_ms(times, times[0], lo)),
            "during": summary(gaps_ms(times, lo, hi)), "window_s": hi - lo, "refusals": refusals,
            "stream_ended_before_refusals": times[-1] < hi}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--huge", type=int, default=4)
    p.add_argument("--huge-chars", type=int, default=650_000)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.tokens, args.huge, args.huge_chars = 80, 1, 200_000
    out_path = args.out or os.path.join(ROOT, "bench", "results",
                                        f"serve-stall-{date.today().isoformat()}-cpu{args.tag}.json")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out: dict = {"bench": "serve_stall", "commit": commit, "date": date.today().isoformat(), "device": "cpu",
                 "cpus": os.cpu_count(), "model": MODEL, "huge_chars": args.huge_chars, "huge": args.huge,
                 "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        s = Serve(tmp)
        try:
            s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            out["run"] = run(s, args.tokens, args.huge, args.huge_chars)
        finally:
            s.stop()
    out["loadavg_end"] = os.getloadavg()
    r = out["run"]
    print(f"{'stream gaps':<22}{'n':>5}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for k in ("before", "during"):
        g = r[k]
        if g["n"]:
            print(f"{k:<22}{g['n']:>5}{g['p50_ms']:>9.1f}{g['p99_ms']:>9.1f}{g['max_ms']:>9.1f}")
    print("refusals:", ", ".join(f"{x['status']} {x['code']} {x['s']:.2f}s" for x in r["refusals"]))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
