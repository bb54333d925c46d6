"""What the parts of the fold (control/fold.py, fold_moves.py, fold_serving.py) note with: an anomaly
(an event the ledger recorded that the state cannot have had), and a worker looked up or noted
missing. Part of the fold: deterministic, no I/O."""
from __future__ import annotations

from residency.control.state import MAX_ANOMALIES_KEPT, State


def anomaly(s: State, seq: int, what: str) -> None:
    if len(s.anomalies) < MAX_ANOMALIES_KEPT:
        s.anomalies.append((seq, what))


def worker_or_anomaly(s: State, worker: int, seq: int, what: str):
    ws = s.workers.get(worker)
    if ws is None:
        anomaly(s, seq, f"{what} names unknown worker {worker}")
    return ws


# what ``state.blocks.get(worker, NO_BLOCKS)`` gives for a worker with no blocks (never written to)
NO_BLOCKS: dict = {}
