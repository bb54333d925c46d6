"""SmolLM2 served through the HTTP API on this CPU: prefill and decode speed, and what a parked
session's second turn costs when its prefix is restored vs recomputed.

    python bench/serve.py                          # -> bench/results/serve-<date>-cpu.json
    python bench/serve.py --quick                  # fewer, shorter requests (checks the script runs)

Each figure is measured through the official ``openai`` client against a real ``residency serve``
(one CPU worker, SQLite ledger), so it includes HTTP, tokenization, admission and the ledger:
  prefill   a long prompt (no session: nothing cached), max_tokens=1; tokens/s = prompt / latency
  decode    one stream, tokens/s after the first token; and 4 concurrent streams, aggregate
  turn 2    a session with a long first turn is parked (host, then disk), then its next turn is
            streamed; TTFT with the prefix restored (``--restore-policy restore``) vs recomputed
            (``--restore-policy recompute``), vs left resident (never parked)
The load average is recorded: on a shared machine every figure is a lower bound.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date

import httpx
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "SmolLM2-135M-Instruct"
KEY = "bench"
FILLER = ("Residency is an inference server whose memory is governed by an event-sourced control plane. "
          "Every movement of KV-cache pages between tiers is written to an append-only ledger. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, tmp: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(dir=tmp)
        argv = [sys.executable, "-m", "residency.control.cli.main", "serve", "--ledger", f"sqlite:///{self.dir}/l.db",
                "--port", str(self.port), "--run-dir", f"{self.dir}/run", "--no-policies", "--admin-key", KEY,
                "--device-blocks", "512", "--no-disk-fsync", *extra]
        self.log = open(f"{self.dir}/serve.log", "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if any(m["id"] == MODEL for m in httpx.get(f"{self.url}/v1/models", timeout=2).json()["data"]):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited: see {self.dir}/serve.log")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=600)

    def admin(self, path: str, **kw) -> dict:
        r = httpx.post(self.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, **kw)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def stream(s: Serve, messages, max_tokens: int, session: str | None = None) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    for ch in s.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"session_id": session} if session else None):
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.perf_counter() - t0)
        if ch.usage:
            usage = ch.usage
    return {"ttft_s": times[0] if times else None, "times": times, "usage": usage,
            "total_s": time.perf_counter() - t0}


def prefill(s: Serve, reps: int, words: int) -> dict:
    rates, sizes = [], []
    for i in range(reps):
        msg = [{"role": "user", "content": f"({i}) " + " ".join(FILLER.split()[:20]) + " " + FILLER * (words // 28)
                + "\nSummarize."}]
        t0 = time.perf_counter()
        r = s.client.chat.completions.create(model=MODEL, messages=msg, max_tokens=1, temperature=0)
        dt = time.perf_counter() - t0
        rates.append(r.usage.prompt_tokens / dt)
        sizes.append(r.usage.prompt_tokens)
    return {"prompt_tokens": sizes, "tokens_per_s": statistics.median(rates), "all": rates}


def decode(s: Serve, max_tokens: int, concurrent: int) -> dict:
    msg = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
    results: list[dict] = []

    def one(i):
        results.append(stream(s, [{"role": "user", "content": f"{msg[0]['content']} ({i})"}], max_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    per_stream = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in results if len(r["times"]) > 2]
    tokens = sum(r["usage"].completion_tokens for r in results)
    return {"streams": concurrent, "completion_tokens": tokens, "wall_s": wall,
            "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else None,
            "aggregate_tokens_per_s": tokens / wall,
            "itl_ms_p50": 1e3 * statistics.median([b - a for r in results for a, b in zip(r["times"], r["times"][1:])])}


def second_turn(s: Serve, words: int, park: str | None, tag: str) -> dict:
    sess = f"bench-{tag}-{park}"
    first = [{"role": "system", "content": "You answer in one sentence. Context: " + FILLER * (words // 28)},
             {"role": "user", "content": "What does Residency record?"}]
    r1 = s.client.chat.completions.create(model=MODEL, messages=first, max_tokens=16, temperature=0,
                                          extra_body={"session_id": sess})
    convo = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And why?"}]
    if park is not None:
        s.admin(f"/admin/sessions/{sess}/park", json={"tier": park})
    r2 = stream(s, convo, 8, session=sess)
    u = r2["usage"]
    return {"park": park, "prompt_tokens": u.prompt_tokens, "cached_tokens": u.prompt_tokens_details.cached_tokens,
            "restored_tokens": u.model_extra["restored_tokens"], "computed_tokens": u.model_extra["computed_tokens"],
            "ttft_s": r2["ttft_s"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", f"serve-{date.today().isoformat()}-cpu.json"))
    args = p.parse_args()
    reps, words, dec_tokens, ctx_words = (1, 120, 16, 200) if args.quick else (3, 900, 64, 1400)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out: dict = {"bench": "serve", "commit": commit, "date": date.today().isoformat(), "device": "cpu",
                 "cpus": os.cpu_count(), "model": MODEL, "dtype": "float32", "page_tokens": 16,
                 "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("restore", "recompute"):
            s = Serve(tmp, "--restore-policy", policy)
            try:
                stream(s, [{"role": "user", "content": "Hello"}], 4)           # warm up
                if policy == "restore":
                    out["prefill"] = prefill(s, reps, words)
                    out["decode_1"] = decode(s, dec_tokens, 1)
                    out["decode_4"] = decode(s, dec_tokens, 4)
                    out["turn2_resident"] = [second_turn(s, ctx_words, None, f"r{i}") for i in range(reps)]
                out[f"turn2_{policy}_host"] = [second_turn(s, ctx_words, "host", f"{policy}{i}") for i in range(reps)]
                out[f"turn2_{policy}_disk"] = [second_turn(s, ctx_words, "disk", f"{policy}{i}") for i in range(reps)]
            finally:
                s.stop()
    med = lambda rows: statistics.median(r["ttft_s"] for r in rows)  # noqa: E731
    out["summary"] = {
        "prefill_tokens_per_s": out["prefill"]["tokens_per_s"],
        "decode_tokens_per_s_1_stream": out["decode_1"]["per_stream_tokens_per_s"],
        "decode_tokens_per_s_4_streams_aggregate": out["decode_4"]["aggregate_tokens_per_s"],
        "turn2_prompt_tokens": out["turn2_restore_host"][0]["prompt_tokens"],
        "turn2_ttft_s_resident": med(out["turn2_resident"]),
        "turn2_ttft_s_restore_from_host": med(out["turn2_restore_host"]),
        "turn2_ttft_s_restore_from_disk": med(out["turn2_restore_disk"]),
        "turn2_ttft_s_recompute_after_park": med(out["turn2_recompute_host"]),
    }
    out["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2, default=str)
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
