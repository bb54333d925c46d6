"""What the parts of the fold (control/fold.py, fold_moves.py, fold_serving.py) note with: an anomaly
(an event the ledger recorded that the state cannot have had), and a worker looked up or noted
missing. Part of the fold: deterministic, no I/O."""
from __future__ import annotations

from residency.control.state import MAX_ANOMALIES_KEPT, State, copy_set


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


def free_copies(s: State, worker: int, tier: str, blocks: list[int], nbytes: int, seq: int, what: str) -> None:
    """Copies of ``blocks`` on ``tier`` are gone, ``nbytes`` reclaimed as the worker measured them
    (a block with no copy left is forgotten). What ``BlocksFreed`` and ``CopiesReleased`` both do."""
    ws = s.workers.get(worker)
    if ws is None:
        anomaly(s, seq, f"{what} names unknown worker {worker}")
        return
    held = s.blocks.get(worker, NO_BLOCKS)
    get = held.get
    dropped = 0
    for bid in blocks:
        b = get(bid)
        if b is None or tier not in b.tiers:
            anomaly(s, seq, f"block {bid} has no copy on {tier} of worker {worker} to free")
            continue
        tiers = b.tiers
        tiers.remove(tier)
        dropped += 1
        if not tiers:
            del held[bid]
    if s.copies is not None:                        # the copy index (a block not there: no change)
        copy_set(s, worker, tier).difference_update(blocks)
    account = ws.tiers[tier]
    account.used_bytes -= dropped * ws.block_bytes
    account.reclaimed_bytes += nbytes
