"""What bench/soak.py checks in the ledger once the server has stopped: the operator's own commands
(``ledger verify``, ``audit stranded``, ``replay``), the SQL view read directly, and two counts made
here from the raw events so that they do not share code with what they check:

  unclosed requests   a ``RequestAdmitted`` with no ``RequestFinished`` at all (a recovery that closes
                      a request with reason ``control_lost`` closes it)
  stranded once       the bytes at risk, each block counted once. A stranded move's blocks belong to
                      the incarnation of its worker that was running when it was requested; if the
                      ``WorkerLost`` that ended that incarnation lists the same blocks as lost, both
                      rows carry those bytes (the overlap in the rows). The books (audit, view,
                      replay) must equal the rows less that overlap; what they count beyond it is
                      counted twice.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

from sqlalchemy import text


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "residency.control.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def verify(url: str) -> dict:
    p = cli("ledger", "verify", "--ledger", url)
    return {"ok": p.returncode == 0, "returncode": p.returncode,
            "output": (p.stdout + p.stderr).strip().splitlines()[-6:]}


def audit_stranded_bytes(url: str) -> int | None:
    p = cli("audit", "stranded", "--json", "--ledger", url, "--limit", "0")
    if p.returncode != 0:
        return None
    return int(json.loads(p.stdout)["total_bytes"])


def replay_summary(url: str) -> dict:
    p = cli("replay", "--json", "--no-snapshots", "--ledger", url)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr).strip()[-600:]}
    s = json.loads(p.stdout)
    # stranded_bytes_total is the fold's whole figure: the lost workers' bytes and the tiers' stranded moves
    lost = sum(w["bytes_lost"] for w in s["workers"])
    return {"integrity": s["integrity"], "stranded_bytes": s["stranded_bytes_total"], "of_which_bytes_lost": lost,
            "seq": s["seq"],
            "requests_waiting_or_running": s["requests_waiting_or_running"],
            "workers_alive": [w["worker"] for w in s["workers"] if w["alive"]], "server_up": s["server_up"]}


def diagnose_findings(url: str) -> dict:
    p = cli("diagnose", "--json", "--ledger", url)
    if p.returncode not in (0, 1):
        return {"error": (p.stdout + p.stderr).strip()[-600:]}
    try:
        found = json.loads(p.stdout)
    except ValueError:
        return {"error": p.stdout[-600:]}
    kinds: dict[str, int] = defaultdict(int)
    for f in found["findings"]:
        kinds[f"{f['severity']}:{f['detector']}"] += 1
    return dict(sorted(kinds.items()))


def ledger_counts(url: str) -> dict:
    """The raw-event counts: requests left open, and the stranded bytes with each block once."""
    from residency.events import catalog as ev  # noqa: PLC0415
    from residency.ledger import LedgerStore  # noqa: PLC0415

    admitted: dict[str, int] = {}
    finished: dict[str, str] = {}
    refused: set[str] = set()
    block_bytes: dict[int, int] = {}
    incarnation: dict[int, int] = defaultdict(int)         # worker -> WorkerLost events so far
    requested: dict[str, tuple[int, int, list[int]]] = {}  # move -> (worker, incarnation, blocks)
    stranded: dict[str, tuple[int, int, str]] = {}         # move -> (bytes at risk, seq, why), while unresolved
    lost: dict[tuple[int, int], tuple[set[int], int, int]] = {}   # (worker, incarnation) -> (blocks, bytes, seq)
    starts: list[int] = []                                 # seqs of ServerStarted
    num_events = 0
    with LedgerStore.open(url) as store, store.engine.connect() as conn:
        view_bytes = int(conn.execute(text("SELECT COALESCE(SUM(bytes), 0) FROM residency_stranded")).scalar_one())
        for rec in store.read():
            num_events += 1
            e, seq = rec.event, rec.envelope.seq
            if isinstance(e, ev.ServerStarted):
                starts.append(seq)
            elif isinstance(e, ev.RequestAdmitted):
                admitted.setdefault(e.request_id, seq)
            elif isinstance(e, ev.RequestFinished):
                finished[e.request_id] = e.reason
            elif isinstance(e, ev.RequestRefused):
                refused.add(e.request_id)
            elif isinstance(e, ev.WorkerJoined):
                block_bytes[e.worker] = e.block_bytes
            elif isinstance(e, ev.MoveRequested):
                requested[e.move_id] = (e.worker, incarnation[e.worker], list(e.blocks))
            elif isinstance(e, ev.MoveStranded):
                stranded[e.move_id] = (e.bytes_at_risk, seq, e.why)
            elif isinstance(e, (ev.MoveLateAcked, ev.MoveLateFailed, ev.CopiesReleased)):
                stranded.pop(e.move_id, None)      # a late answer ends the stranding
            elif isinstance(e, ev.WorkerLost):
                lost[(e.worker, incarnation[e.worker])] = (set(e.blocks_lost), e.bytes_lost, seq)
                incarnation[e.worker] += 1
    unclosed = sorted((seq, rid) for rid, seq in admitted.items() if rid not in finished)
    double, double_moves = 0, []
    for mid, (at_risk, seq, why) in stranded.items():
        worker, inc, blocks = requested.get(mid, (None, None, []))
        gone = lost.get((worker, inc))
        if gone is None:
            continue
        both = gone[0].intersection(blocks)
        if both:
            over = min(at_risk, len(both) * block_bytes.get(worker, 0))
            double += over
            double_moves.append({"move_id": mid, "stranded_seq": seq, "why": why, "worker_lost_seq": gone[2],
                                 "blocks_in_both": len(both), "bytes_in_both": over})
    rows_bytes = sum(b for b, _, _ in stranded.values()) + sum(b for _, b, _ in lost.values())
    return {
        "num_events": num_events,
        "requests_admitted": len(admitted),
        "requests_finished_by_reason": _count(finished.values()),
        "requests_unclosed": len(unclosed),
        "requests_unclosed_first": [{"admitted_seq": s, "request_id": r, "next_server_started_seq": _after(starts, s)}
                                    for s, r in unclosed[:10]],
        "requests_unclosed_before_a_restart": sum(1 for s, _ in unclosed if _after(starts, s) is not None),
        "requests_closed_control_lost": sum(1 for r in finished.values() if r == "control_lost"),
        "requests_refused_in_ledger": len(refused),
        "worker_lost_events": sum(incarnation.values()),
        "stranded_view_bytes": view_bytes,
        "stranded_rows_bytes": rows_bytes,
        "stranded_once_bytes": rows_bytes - double,
        "stranded_overlap_in_rows_bytes": double,
        "stranded_overlap_moves": double_moves[:10],
    }


def _after(seqs: list[int], seq: int) -> int | None:
    return next((s for s in seqs if s > seq), None)


def _count(values) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for v in values:
        out[v] += 1
    return dict(sorted(out.items()))


def log_errors(logs) -> dict[str, int]:
    """Error-level lines of the serve logs, by event name and the exception's last line: JSON lines
    from structlog, and the tracebacks uvicorn prints itself for an exception that escaped the app.
    A client that hangs up, or a worker lost, is not an error the server failed to handle."""
    found: dict[str, int] = defaultdict(int)
    for path in logs:
        in_traceback = False
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict):
                if line.startswith("Exception in ASGI application"):
                    in_traceback = True
                elif in_traceback and line and not line[0].isspace() and not line.startswith("Traceback"):
                    found[f"uncaught in ASGI ({line[:120]})"] += 1
                    in_traceback = False
                continue
            if rec.get("level") not in ("error", "critical"):
                continue
            exc = (rec.get("exception") or "").strip().splitlines()
            found[rec.get("event", "?") + (f" ({exc[-1][:120]})" if exc else "")] += 1
    return dict(sorted(found.items()))


def disk_claims(logs) -> list[dict]:
    """What each starting worker did with the disk-tier files it found (logged ``disk_claimed``)."""
    out = []
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if '"disk_claimed"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out.append({k: rec.get(k) for k in ("timestamp", "worker", "kept", "dropped", "bytes_dropped")})
    return sorted(out, key=lambda r: r["timestamp"] or "")
