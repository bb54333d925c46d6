"""`residency serve` as bench/serve_e2e.py runs it, and what it reads back from the server: its
/metrics (counters diffed around a level, the ledger's append lag sampled during one) and, after
it stops, its SQLite ledger (the bytes each kind of move carried in a level's time window).

Ledger append lag, as the table reports it: at a sampling instant, how long the oldest event the
control process has recorded (and folded) has waited without being committed to the ledger;
0 when nothing waits. /metrics exposes it as ``residency_ledger_append_lag_seconds`` (the
recorder's ``lag_ns``). A sampler thread reads it every ``every_s`` while a level runs; the p99 is
over those samples. An event's lag is at most the lag of the oldest waiting event at any instant
it waits, so the samples bound every event's wait from above at those instants; a wait shorter
than the sampling period can fall between two samples. Events the workers produce are timed
from the moment the control process records them.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from soak import Serve                                # noqa: E402  (bench/soak.py: argv, start, stop)


class Server:
    """One `residency serve` (its own ledger and run dir under ``work``), started as a user would."""

    def __init__(self, work: Path, args: list[str]):
        work.mkdir(parents=True, exist_ok=True)
        self.serve = Serve(work, args)
        self.url, self.work = self.serve.url, work
        self.db_path = work / "ledger.db"
        self.model: str | None = None

    def start(self, deadline_s: float) -> float:
        """Seconds until /v1/models names a model and one chat request is answered."""
        t0 = time.monotonic()
        self.serve.start()
        while time.monotonic() - t0 < deadline_s:
            if self.serve.proc.poll() is not None:
                raise RuntimeError(f"residency serve exited with {self.serve.proc.returncode}; logs in {self.work}")
            try:
                data = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
                if data:
                    self.model = data[0]["id"]
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError(f"residency serve did not answer within {deadline_s} s; logs in {self.work}")
        r = httpx.post(self.url + "/v1/chat/completions", timeout=max(10.0, deadline_s - (time.monotonic() - t0)),
                       json={"model": self.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "messages": [{"role": "user", "content": "Warm up."}]})
        if r.status_code != 200:
            raise RuntimeError(f"the warm-up request got {r.status_code}: {r.text[:300]}")
        return time.monotonic() - t0

    def stop(self) -> int | None:
        rc = self.serve.stop()
        for pid in self.serve.worker_pids():             # started by this serve: ours to end
            import os
            import signal
            os.kill(pid, signal.SIGKILL)
        return rc

    def log_tail(self, lines: int = 30) -> list[str]:
        logs = sorted(self.work.glob("serve-*.log"))
        return logs[-1].read_text(errors="replace").splitlines()[-lines:] if logs else []


# ------------------------------------------------------------------ /metrics
def scrape(url: str) -> dict[tuple, float]:
    """Every sample of /metrics as {(name, sorted label items): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counter_diff(before: dict, after: dict, name: str, label: str) -> dict[str, float]:
    """{label value: after - before} of the counter ``name`` (its ``_total`` samples)."""
    out: Counter = Counter()
    for (n, labels), v in after.items():
        if n in (name, name + "_total"):
            key = ",".join(val for k, val in labels if k == label or label == "*")
            out[key] += v - before.get((n, labels), 0.0)
    return {k: v for k, v in sorted(out.items()) if v}


class LagSampler:
    """Reads the ledger append lag from /metrics every ``every_s`` until stopped."""

    def __init__(self, url: str, every_s: float = 0.2):
        self.url, self.every_s = url, every_s
        self.samples_ms: list[float] = []
        self.num_unmeasured = 0                          # NaN: the server did not measure it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LagSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                m = scrape(self.url)
            except httpx.HTTPError:
                continue
            v = m.get(("residency_ledger_append_lag_seconds", ()))
            if v is None or v != v:
                self.num_unmeasured += 1
            else:
                self.samples_ms.append(v * 1e3)


# ------------------------------------------------------------------ the ledger, after the run
def moved_bytes(db_path: Path, windows: dict[str, tuple[int, int]]) -> dict[str, dict]:
    """Per window (ts_ns bounds): {move kind: {...}} of the moves requested in it: ``bytes_moved``
    as the workers measured it in their acks (late acks included), ``bytes_released`` of the
    evictions (which end with CopiesReleased: nothing is copied), and ``open``: moves with no
    such ending in the ledger (failed, stranded or still in flight when the server stopped)."""
    from residency.events.codec import decode_event

    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        req = {mid: (kind, ts) for mid, kind, ts in con.execute(
            "SELECT move_id, kind, ts_ns FROM events WHERE type = 'MoveRequested'")}
        acked, released = {}, {}
        for mid, payload, typ, ver in con.execute(
                "SELECT move_id, payload, type, schema_version FROM events WHERE type IN ('MoveAcked', 'MoveLateAcked')"):
            acked[mid] = decode_event(payload, typ, ver).bytes_moved
        for mid, nbytes in con.execute("SELECT move_id, bytes FROM events WHERE type = 'CopiesReleased'"):
            released[mid] = released.get(mid, 0) + (nbytes or 0)
    finally:
        con.close()
    out: dict[str, dict] = {}
    for name, (a, b) in windows.items():
        per: dict[str, dict] = {}
        for mid, (kind, ts) in req.items():
            if a <= ts <= b:
                row = per.setdefault(kind, {"moves": 0, "bytes_moved": 0, "bytes_released": 0, "open": 0})
                row["moves"] += 1
                if mid in acked:
                    row["bytes_moved"] += acked[mid]
                elif mid in released:
                    row["bytes_released"] += released[mid]
                else:
                    row["open"] += 1
        out[name] = per
    return out
