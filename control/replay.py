"""Replay: fold a ledger up to a point, starting from the nearest snapshot.

Pure over what the store returns; the store is the only I/O. ``progress`` is any callable
taking the number of events folded since the last call (the CLI passes a tqdm bar's update).
"""
from __future__ import annotations

from typing import Callable

from events.codec import DecodeError, decode_event
from control.fold import fold_decoded
from control.state import State, decode_state, encode_state, state_hash


class ReplayError(Exception):
    """A replay that cannot be done as asked (a seq beyond the end, a snapshot that lies)."""


def replay(store, to_seq: int | None = None, *, use_snapshots: bool = True,
           progress: Callable[[int], None] | None = None) -> tuple[State, int]:
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
    if start < target:
        _fold_range(state, store, start + 1, target, progress)
    return state, start


def _fold_range(state: State, store, lo: int, hi: int, progress=None) -> None:
    for rows in store.raw_batches(lo, hi):
        fold_decoded(state, _decoded(rows))
        if progress is not None:
            progress(len(rows))


def _decoded(rows):
    """(seq, ts_ns, event) from raw rows; a payload that does not decode is named by its seq."""
    for r in rows:
        seq = r[0]
        try:
            yield seq, r[1], decode_event(r[9], r[5], r[6])
        except DecodeError as e:
            raise ReplayError(f"seq {seq}: {e}") from e


def write_snapshots(store, every: int = 100_000, progress=None) -> list[int]:
    """Fold the whole ledger once and save a snapshot every ``every`` events. Returns their seqs."""
    state, pos, saved = State(), 0, []
    last = store.last_seq()
    while pos < last:
        hi = min(last, pos + every)
        _fold_range(state, store, pos + 1, hi, progress)
        pos = hi
        if pos % every == 0 or pos == last:
            store.save_snapshot(pos, encode_state(state), state_hash(state))
            saved.append(pos)
    return saved


def check_checkpoints(store, checkpoints, progress=None) -> list[str]:
    """Fold once from zero and compare each recorded StateCheckpoint; return the mismatches."""
    problems: list[str] = []
    wanted = sorted((through, seq, h) for seq, through, h in checkpoints)
    state, pos = State(), 0
    for through, seq, h in wanted:
        if through > pos:
            _fold_range(state, store, pos + 1, through, progress)
            pos = through
        got = state_hash(state)
        if got != h:
            problems.append(f"seq {seq}: StateCheckpoint through seq {through} says state hash {h[:16]}…, "
                            f"replay gives {got[:16]}…")
    return problems
