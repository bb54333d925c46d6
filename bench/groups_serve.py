"""`residency serve --tp N` end to end, against `--tp 1` on the same host in the same run.

    python bench/groups_serve.py --device cuda --tp 2        # two GPUs: NCCL, cuda:0 and cuda:1
    python bench/groups_serve.py --device cpu --tp 3 --model embedded   # gloo, SmolLM2 (CI-sized)

Each size is served by a real `residency serve` (its own ledger), asked the same greedy
completions one after another over HTTP, then stopped. Reported per size: tokens/s as the client
sees them, the greedy texts (the same as --tp 1's or not), and from the ledger: each rank's
StepCompleted count, its KV block bytes (1/N of the whole block's) and any GroupDiverged /
GroupStopped row (a healthy group has none). The model is `--model PATH|embedded`, or by default
a random-weight Llama-shaped directory (bench/dial.py's shape, whose heads divide by 2 and 4):
random weights give near-flat logits, so their greedy texts may differ across sizes by rounding,
which is reported, not judged.

Prints a table; writes JSON under bench/results/ (or --out DIR) with the git commit and `targets`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from commit import git_commit  # noqa: E402
from dial import free_port, write_model  # noqa: E402

PROMPTS = ["The capital of France is", "Write one sentence about the sea and a lighthouse keeper.",
           "List three colours:", "Once upon a time"]


def log(*a) -> None:
    print(*a, flush=True)


def serve(tmp: str, model: str, device: str, tp: int, device_blocks: int):
    port = free_port()
    db = f"sqlite:///{tmp}/l.db"
    argv = [sys.executable, "-m", "residency.control.cli.main", "serve", "--ledger", db, "--port", str(port),
            "--run-dir", f"{tmp}/run", "--no-policies", "--retain-prefixes", "0", "--model", model,
            "--device", device, "--device-blocks", str(device_blocks), "--host-bytes", "512MiB",
            "--no-disk-fsync", "--drain-s", "0", "--tp", str(tp)]
    if device == "cuda" and tp == 1:
        argv += ["--workers", "1"]
    out = open(f"{tmp}/serve.log", "wb")
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"serve --tp {tp} exited {p.returncode}: see {tmp}/serve.log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return p, url, db
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.kill()
    raise RuntimeError(f"serve --tp {tp} not ready in 600 s: see {tmp}/serve.log")


def stop(p) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def ledger_facts(db: str) -> dict:
    from residency.ledger import LedgerStore

    store = LedgerStore.open(db)
    try:
        events = [r.event for r in store.read()]
    finally:
        store.close()
    steps: dict[int, int] = {}
    block_bytes: dict[int, int] = {}
    for e in events:
        name = type(e).__name__
        if name == "StepCompleted":
            steps[e.worker] = steps.get(e.worker, 0) + 1
        elif name == "WorkerJoined":
            block_bytes[e.worker] = e.block_bytes
    return {"steps_by_worker": steps, "block_bytes_by_worker": block_bytes,
            "group_diverged": sum(type(e).__name__ == "GroupDiverged" for e in events),
            "group_stopped": sum(type(e).__name__ == "GroupStopped" for e in events)}


def run_size(args, model: str, tp: int) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"groups-tp{tp}-", dir=args.tmp)
    t0 = time.perf_counter()
    p, url, db = serve(tmp, model, args.device, tp, args.device_blocks)
    ready_s = time.perf_counter() - t0
    texts, tokens, seconds = [], 0, 0.0
    try:
        for i in range(args.rounds):
            for prompt in PROMPTS:
                t = time.perf_counter()
                r = httpx.post(f"{url}/v1/completions", timeout=600, json={
                    "model": httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"], "prompt": prompt,
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
                if i > 0:                  # the first round warms up
                    seconds += time.perf_counter() - t
                    tokens += r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                if i == 0:
                    texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}")
    finally:
        stop(p)
    facts = ledger_facts(db)
    return {"tp": tp, "ready_s": round(ready_s, 1), "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "texts": texts, **facts, "dir": tmp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="random", help="a path, 'embedded' (SmolLM2: --tp 3 only), or 'random'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the prompts (the first warms up)")
    ap.add_argument("--device-blocks", type=int, default=512)
    ap.add_argument("--tmp", default=None, help="where the ledgers and logs go (default: the temp dir)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    model = args.model
    if model == "random":
        model, _ = write_model(tempfile.mkdtemp(prefix="groups-model-", dir=args.tmp), args.device)
    one, many = run_size(args, model, 1), run_size(args, model, args.tp)
    same = [a == b for a, b in zip(one["texts"], many["texts"])]
    whole = next(iter(one["block_bytes_by_worker"].values()), None)
    shards = sorted(set(many["block_bytes_by_worker"].values()))
    result = {
        "bench": "groups_serve", "commit": git_commit(), "date": date.today().isoformat(), "device": args.device,
        "model": args.model, "max_tokens": args.max_tokens, "tp1": one, f"tp{args.tp}": many,
        "same_greedy_texts": same,
        "targets": {"no_group_diverged": many["group_diverged"] == 0 and many["group_stopped"] == 0,
                    "every_rank_stepped_alike": len(set(many["steps_by_worker"].values())) == 1
                    and len(many["steps_by_worker"]) == args.tp,
                    "block_bytes_split": whole is not None and shards == [whole // args.tp]},
    }
    log(f"{'size':>6} {'ready s':>8} {'tok/s':>8} {'steps by rank':>24} {'block bytes':>12} {'diverged':>9}")
    for r in (one, many):
        log(f"tp{r['tp']:<4} {r['ready_s']:>8} {r['tokens_per_s']!s:>8} {json.dumps(r['steps_by_worker']):>24} "
            f"{json.dumps(sorted(set(r['block_bytes_by_worker'].values()))):>12} {r['group_diverged']:>9}")
    log(f"same greedy texts as tp1: {same}; targets: {result['targets']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"groups-serve-{result['date']}-{args.device}-tp{args.tp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
