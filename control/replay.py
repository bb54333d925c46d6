"""Replay: fold a ledger up to a point, starting from the nearest snapshot.

Pure over what the store returns; the store is the only I/O. ``progress`` is any callable
taking the number of events folded since the last call (the CLI passes a tqdm bar's update).
"""
from __future__ import annotations

from typing import Callable

from events.codec import DecodeError, decode_event
from control.fold import fold_all, fold_decoded
from control.state import State, decode_state, encode_state, state_hash


class ReplayError(Exception):
    """A replay that cannot be done as asked (a seq beyond the end, a snapshot that lies)."""


def replay(store, to_seq: int | None = None, *, use_snapshots: bool = True,
           progress: Callable[[int], None] | None = None, chunk: int = 20_000) -> tuple[State, int]:
    """Fold the ledger through ``to_seq`` (default: the end). Returns (state, snapshot seq used or 0)."""
    last = store.last_seq()
    target = last if to_seq is None else to_seq
    if target < 0 or target > last:
        raise ReplayError(f"seq {target} is beyond the end of the ledger (last seq {last})")
    state, start = State(), 0
    if use_snapshots and target > 0:
        snap = store.load_snapshot(target)
        if snap is not None:
            state = decode_state(snap.state_bytes)
            if state_hash(state) != snap.state_hash:
                raise ReplayError(f"snapshot at seq {snap.through_seq} does not match its recorded hash")
            start = snap.through_seq
    snapshot_seq = start
    if start < target:
        for rows in store.raw_batches(start + 1, target):
            fold_decoded(state, _decoded(rows))
            if progress is not None:
                progress(len(rows))
    return state, snapshot_seq


def _decoded(rows):
    """(seq, ts_ns, event) from raw rows; a payload that does not decode is named by its seq."""
    for r in rows:
        seq = r[0]
        try:
            yield seq, r[1], decode_event(r[9], r[5], r[6])
        except DecodeError as e:
            raise ReplayError(f"seq {seq}: {e}") from e
