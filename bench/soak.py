"""A bounded soak of `residency serve` on this CPU: honest and hostile clients at once, while the
workers and the control process are killed with SIGKILL at random moments (issue #26).

    python bench/soak.py                               # 180 s -> bench/results/soak-<date>-cpu.json
    python bench/soak.py --duration 20 --clients 2     # a short look
    python bench/soak.py --hostile tiny_temperature,short_body --seed 7

The server is started as a user starts it (`residency serve`, the embedded model, an SQLite ledger
in a temporary directory). ``--clients`` threads hold multi-turn sessions with think time; a
``--hostile-fraction`` of their requests are drawn from the hostile kinds (bench/soak_clients.py).
Every ``--kill-every`` seconds on average (seeded), a worker (its pid file in the run directory) or
the control process (the `residency serve` process itself: the HTTP API and the ledger writer) gets
SIGKILL. The supervisor inside `serve` restarts a worker on its own; a dead control process is
restarted the way an operator would, by running the same `residency serve` on the same ledger, which
adopts the workers that survived it.

When ``--duration`` is over, the clients finish what they sent (each request has a client timeout),
the server answers one last valid request, stops on SIGTERM, and the ledger is checked: `ledger
verify`, requests admitted but never closed, stranded bytes by the audit, the SQL view and replay
against each block counted once (bench/soak_checks.py). The table and the JSON's ``targets`` say
which of these held. Nothing here is a speed figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from datetime import date
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from commit import ROOT, git_commit  # noqa: E402
from soak_checks import (audit_stranded_bytes, diagnose_findings, disk_claims, ledger_counts, log_errors,  # noqa: E402
                         replay_summary, verify)  # noqa: E402
from soak_clients import HOSTILE_KINDS, MODEL, Client, Outcome, Sessions  # noqa: E402

ADMIN_KEY = "soak"


def log(*a) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}]", *a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`residency serve` on one ledger, run dir and port; started again after each SIGKILL."""

    def __init__(self, work: Path, extra: list[str]):
        self.work, self.port = work, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ledger = f"sqlite:///{work / 'ledger.db'}"
        self.run_dir = work / "run"
        self.argv = [sys.executable, "-m", "residency.control.cli.main", "serve", "--ledger", self.ledger,
                     "--port", str(self.port), "--run-dir", str(self.run_dir), "--admin-key", ADMIN_KEY,
                     "--device-blocks", "256", "--host-bytes", "256MiB", "--disk-bytes", "512MiB",
                     "--no-disk-fsync", "--drain-s", "10", *extra]
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0
        self.lock = threading.Lock()

    def start(self) -> None:
        self.num_starts += 1
        out = open(self.work / f"serve-{self.num_starts}.log", "wb")
        env = dict(os.environ, RESIDENCY_LOG_FORMAT="json")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        out.close()

    def ready(self, deadline_s: float) -> float | None:
        """Seconds until a valid chat request is answered 200 (None: not within ``deadline_s``)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline_s:
            if self.proc is not None and self.proc.poll() is not None:
                return None
            if final_request(self.url, timeout_s=20)["ok"]:
                return time.monotonic() - t0
            time.sleep(0.5)
        return None

    def worker_pids(self) -> list[int]:
        pids = []
        for f in sorted(self.run_dir.glob("worker-*.pid")):
            try:
                pids.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return [p for p in pids if _alive(p)]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def final_request(url: str, timeout_s: float) -> dict:
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=timeout_s, json={
            "model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name one colour."}]})
        ok = r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])
        return {"ok": ok, "status": r.status_code}
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


class Killer:
    """SIGKILL of a worker or of the control process at seeded random moments; restarts the control
    process as an operator would and records how long the server took to answer again."""

    def __init__(self, serve: Serve, rng: random.Random, every_s: float, control_share: float):
        self.serve, self.rng, self.every_s, self.control_share = serve, rng, every_s, control_share
        self.kills: list[dict] = []

    def run(self, t0: float, stop_at: float) -> None:
        while True:
            wait = self.rng.uniform(0.5 * self.every_s, 1.5 * self.every_s)
            if time.monotonic() + wait >= stop_at:
                return
            time.sleep(wait)
            target = "control" if self.rng.random() < self.control_share else "worker"
            self.kills.append(self.kill(target, round(time.monotonic() - t0, 1)))

    def kill(self, target: str, at_s: float) -> dict:
        rec: dict = {"at_s": at_s, "target": target}
        if target == "worker":
            pids = self.serve.worker_pids()
            if not pids:
                rec["skipped"] = "no worker running"
                return rec
            rec["pid"] = pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            log(f"kill -9 worker pid {pid}")
        else:
            proc = self.serve.proc
            rec["pid"] = proc.pid
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            log(f"kill -9 control (residency serve pid {proc.pid}); starting it again")
            time.sleep(1.0)                  # the operator notices, then runs the same command again
            self.serve.start()
        rec["answering_again_s"] = self.serve.ready(deadline_s=180)
        log(f"  serving again after {rec['answering_again_s']} s")
        return rec


def by_class(outcomes: list[Outcome]) -> dict:
    table: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        table[o.kind][o.result] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(table.items())}


def examples(outcomes: list[Outcome]) -> dict:
    """The first few details of each (kind, result) that is not a plain success."""
    ex: dict[str, list] = defaultdict(list)
    for o in outcomes:
        key = f"{o.kind}/{o.result}"
        if o.result != "2xx" and len(ex[key]) < 3:
            ex[key].append({"status": o.status, "seconds": round(o.seconds, 2), "detail": o.detail})
    return dict(ex)


def judge(figures: dict) -> dict:
    targets = {
        "unanswered": (figures["requests_unanswered"], 0, lambda m, t: m == t),
        "unclosed": (figures["ledger"]["requests_unclosed"], 0, lambda m, t: m == t),
        "verify_ok": (int(figures["verify"]["ok"]), 1, lambda m, t: m == t),
        "stranded_double_counted_bytes": (figures["stranded_double_counted_bytes"], 0, lambda m, t: m == t),
        "stranded_audit_view_replay_agree": (int(figures["stranded_agree"]), 1, lambda m, t: m == t),
        "replay_integrity_ok": (int(figures["replay"].get("integrity") == "ok"), 1, lambda m, t: m == t),
        "serving_after": (int(figures["final_request"]["ok"]), 1, lambda m, t: m == t),
    }
    return {k: {"measured": m, "target": t, "met": bool(ok(m, t))} for k, (m, t, ok) in targets.items()}


def print_table(doc: dict) -> list[str]:
    rows = [f"{'request kind':<24}" + "".join(f"{c:>14}" for c in doc["result_columns"])]
    for kind, counts in doc["requests_by_kind"].items():
        rows.append(f"{kind:<24}" + "".join(f"{counts.get(c, 0):>14}" for c in doc["result_columns"]))
    rows.append(f"{'all':<24}" + "".join(f"{doc['requests_by_result'].get(c, 0):>14}" for c in doc["result_columns"]))
    k = Counter(x["target"] for x in doc["kills"] if "skipped" not in x)
    rows.append(f"kills: {k.get('worker', 0)} worker, {k.get('control', 0)} control; serve started "
                f"{doc['serve_starts']} times")
    led, rep = doc["ledger"], doc["replay"]
    rows.append(f"ledger: {led['num_events']} events, {led['requests_admitted']} requests admitted, "
                f"{led['requests_unclosed']} never closed ({led['requests_unclosed_before_a_restart']} of them before a "
                f"restart), {led['requests_closed_control_lost']} closed by recovery")
    rows.append(f"stranded bytes: audit {doc['stranded_audit_bytes']}, view {led['stranded_view_bytes']}, "
                f"replay {rep.get('stranded_bytes')}, each block once {led['stranded_once_bytes']} "
                f"(rows overlap: {led['stranded_overlap_in_rows_bytes']}; "
                f"counted twice by the books: {doc['stranded_double_counted_bytes']})")
    rows.append(f"ledger verify: {'ok' if doc['verify']['ok'] else 'FAILED'}: {' | '.join(doc['verify']['output'][-2:])}")
    rows.append(f"diagnose: {doc['diagnose'] or 'no findings'}")
    rows.append(f"error lines in the serve logs: {doc['log_errors'] or 'none'}")
    claims = [c for c in doc["disk_claims"] if c["kept"] or c["dropped"]]
    rows.append("disk files found by starting workers: " + ("; ".join(
        f"kept {c['kept']}, dropped {c['dropped']}" for c in claims) or "none"))
    for name, v in doc["targets"].items():
        rows.append(f"target {name}: {v['measured']} (target {v['target']}) {'met' if v['met'] else 'MISSED'}")
    print("\n".join(rows), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    p.add_argument("--clients", type=int, default=6, help="concurrent simulated users (default 6)")
    p.add_argument("--hostile-fraction", type=float, default=0.3, help="share of requests that are hostile")
    p.add_argument("--hostile", default=",".join(HOSTILE_KINDS),
                   help=f"comma-separated hostile kinds (default all: {','.join(HOSTILE_KINDS)}); '' for none")
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between kills (0: no kills)")
    p.add_argument("--control-share", type=float, default=0.4, help="share of kills aimed at the control process")
    p.add_argument("--client-timeout", type=float, default=60.0, help="seconds a request may go unanswered")
    p.add_argument("--think", type=float, default=2.0, help="most seconds a user thinks between turns")
    p.add_argument("--oversize-mib", type=float, default=8.0, help="size of the oversize hostile body")
    p.add_argument("--seed", type=int, default=26)
    p.add_argument("--keep-dir", action="store_true", help="keep the ledger and the logs (their path is printed)")
    p.add_argument("--out", default=None)
    p.add_argument("serve_args", nargs="*", help="more `residency serve` options (after --)")
    args = p.parse_args()
    hostile = [h for h in args.hostile.split(",") if h]
    unknown = set(hostile) - set(HOSTILE_KINDS)
    if unknown:
        p.error(f"unknown hostile kinds {sorted(unknown)}; known: {HOSTILE_KINDS}")
    out_path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"soak-{date.today().isoformat()}-cpu.json"
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    load_before = os.getloadavg()
    serve = Serve(work, args.serve_args)
    log(f"ledger {serve.ledger}, logs in {work}")
    serve.start()
    first_ready_s = serve.ready(deadline_s=300)
    if first_ready_s is None:
        log(f"residency serve never answered; see {work}")
        return 2

    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def record(o: Outcome) -> None:
        with lock:
            outcomes.append(o)

    sessions = Sessions()
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    clients = [Client(i, serve.url, ADMIN_KEY, random.Random(rng.random()), sessions, args.client_timeout,
                      args.hostile_fraction, hostile, args.think, int(args.oversize_mib * 2**20), record)
               for i in range(args.clients)]
    threads = [threading.Thread(target=c.run, args=(stop_at,), name=f"client-{c.idx}", daemon=True) for c in clients]
    killer = Killer(serve, random.Random(rng.random()), args.kill_every, args.control_share)
    if args.kill_every > 0:
        threads.append(threading.Thread(target=killer.run, args=(t0, stop_at), name="killer", daemon=True))
    for t in threads:
        t.start()
    # a client's last request may start just before stop_at and take its whole timeout; a kill may
    # wait up to 180 s for the server to answer again
    for t in threads:
        t.join(args.duration + args.client_timeout + 240)
    stuck = [t.name for t in threads if t.is_alive()]
    load_run = os.getloadavg()

    died_unasked = None
    if serve.proc.poll() is not None:        # only a kill of ours may have stopped it
        if serve.proc.returncode != -signal.SIGKILL:
            died_unasked = serve.proc.returncode
            log(f"residency serve exited by itself with {died_unasked}; starting it again")
        serve.start()
    ready_s = serve.ready(deadline_s=180)
    final = final_request(serve.url, timeout_s=args.client_timeout)
    try:
        health = httpx.get(f"{serve.url}/health", timeout=10)
        final["health"] = health.status_code
    except httpx.HTTPError as e:
        final["health"] = f"{type(e).__name__}"
    final["ready_after_run_s"] = ready_s
    log(f"final request: {final}")
    rc = serve.stop()
    leftover = serve.worker_pids()
    for pid in leftover:                     # ours: started by the serve processes of this run
        os.kill(pid, signal.SIGKILL)

    figures: dict = {"final_request": final, "verify": verify(serve.ledger), "ledger": ledger_counts(serve.ledger),
                     "replay": replay_summary(serve.ledger)}
    figures["stranded_audit_bytes"] = audit_stranded_bytes(serve.ledger)
    once = figures["ledger"]["stranded_once_bytes"]
    figures["stranded_double_counted_bytes"] = max(0, (figures["stranded_audit_bytes"] or 0) - once)
    figures["stranded_agree"] = (figures["stranded_audit_bytes"] == figures["ledger"]["stranded_view_bytes"]
                                 == figures["replay"].get("stranded_bytes") == once)
    figures["requests_unanswered"] = sum(1 for o in outcomes if o.result == "unanswered")
    result_columns = ["2xx", "4xx", "500", "5xx", "stream_error", "no_server", "cut", "stream_cut", "client_closed",
                      "unanswered"]
    result_columns += sorted({o.result for o in outcomes} - set(result_columns))     # 1xx, 3xx: shown, never hidden
    doc = {
        "bench": "soak", "date": date.today().isoformat(), "git_commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_during": load_run,
                    "loadavg_after": os.getloadavg(), "device": "cpu"},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "keep_dir")} | {"hostile": hostile},
        "first_ready_s": first_ready_s, "serve_starts": serve.num_starts, "serve_last_returncode": rc,
        "serve_exited_unasked_returncode": died_unasked,
        "workers_left_after_stop": leftover, "threads_stuck": stuck,
        "requests_sent": len(outcomes), "result_columns": result_columns,
        "requests_by_result": dict(Counter(o.result for o in outcomes)), "requests_by_kind": by_class(outcomes),
        "examples": examples(outcomes), "kills": killer.kills,
        **figures, "diagnose": diagnose_findings(serve.ledger),
        "log_errors": log_errors(sorted(work.glob("serve-*.log"))),
        "disk_claims": disk_claims(sorted(work.glob("serve-*.log"))),
    }
    doc["targets"] = judge(doc)
    doc["table"] = print_table(doc)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    log(f"wrote {out_path}")
    if args.keep_dir:
        log(f"ledger and logs kept in {work}")
    else:
        import shutil  # noqa: PLC0415
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
