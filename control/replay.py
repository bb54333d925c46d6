"""Replay: fold a ledger up to a point, starting from the nearest snapshot.

Pure over what the store returns; the store is the only I/O. ``progress`` is any callable
taking the number of events folded since the last call (the CLI passes a tqdm bar's update).

Speed (bench/replay.py): SQLite packs each gapless run of rows into one bytes of payloads and
two strings (``LedgerStore.packed_runs``, on the prefetch thread), msgspec decodes the whole run
in one call (``events.codec.decode_packed``, which checks every row's type and span) and
``fold_run`` folds it: no per-row tuples or envelopes. PostgreSQL sends (type, schema version,
payload) rows instead (``LedgerStore.payload_runs``; it is faster at that), each payload
decoded as its row's type; so does a run with a row of an older schema, which
``decode_event`` upcasts. A packed run that does not decode is read again as rows, and
``decode_event`` names the seq of the bad payload; a range with a gap comes as whole rows
with their seqs.
"""
from __future__ import annotations

import contextlib
import gc
import time
from operator import call, itemgetter
from typing import Callable

import msgspec
import structlog

from residency.events.catalog import StateCheckpoint
from residency.events.envelope import Envelope
from residency.events.codec import PAYLOAD_ERRORS, DecodeError, current_decoders, decode_event, decode_packed
from residency.control.fold import fold_decoded, fold_run
from residency.control.state import State, decode_state, encode_state, state_hash, this_fold
from residency.ledger.schema import PackedRun, PayloadRun


_payload = itemgetter(2)
log = structlog.get_logger("control.replay")
SNAPSHOT_PRODUCER = "ledger-snapshot"      # the producer of the StateCheckpoints `ledger snapshot` records


class ReplayError(Exception):
    """A replay that cannot be done as asked (a seq beyond the end, a snapshot that lies)."""


def replay(store, to_seq: int | None = None, *, use_snapshots: bool = True,
           progress: Callable[[int], None] | None = None) -> tuple[State, int]:
    """Fold the ledger through ``to_seq`` (default: the end). Returns (state, snapshot seq used or 0).

    A snapshot the chain does not vouch for, or whose bytes do not hash to what it claims, is
    not used (a warning names its seq): the fold starts from the first event instead.
    """
    last = store.last_seq()
    target = last if to_seq is None else to_seq
    if target < 0 or target > last:
        raise ReplayError(f"seq {target} is beyond the end of the ledger (last seq {last})")
    state, start = State(), 0
    if use_snapshots and target > 0:
        state, start = usable_snapshot(store, target)
    if start < target:
        _fold_range(state, store, start + 1, target, progress)
    return state, start


def usable_snapshot(store, at_or_before_seq: int) -> tuple[State, int]:
    """(the state of the newest snapshot at or before the seq, its seq), or (State(), 0) when
    there is none or it must not be used: the chain does not vouch for it (``Snapshot.refused``),
    or its bytes are not the state its hash names. The refusal is logged with the seq."""
    snap = store.load_snapshot(at_or_before_seq)
    if snap is None:
        return State(), 0
    why = snap.refused
    if why is None:
        try:
            state = decode_state(snap.state_bytes)
        except msgspec.DecodeError as e:
            why = f"the snapshot through seq {snap.through_seq} does not decode: {e}"
        else:
            if state_hash(state) != snap.state_hash or state.last_seq != snap.through_seq:
                why = f"the snapshot through seq {snap.through_seq} does not match its recorded hash"
    if why is not None:
        log.warning("snapshot_refused", through_seq=snap.through_seq, why=why)
        return State(), 0
    return state, snap.through_seq


@contextlib.contextmanager
def _collector_paused():
    """Pause the cyclic garbage collector while a long fold runs.

    NOTE: a replay allocates millions of short-lived containers (decoded events, their lists)
    while the state it builds grows to hundreds of thousands of objects; the collector's
    generational passes keep re-walking that state. Nothing a fold builds is cyclic, so pausing
    loses nothing; plain reference counting still frees everything. The collector is
    process-wide: it is restored on the way out, even on error, and left alone if it was off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _fold_range(state: State, store, lo: int, hi: int, progress=None) -> None:
    with _collector_paused():
        for run in store.packed_runs(lo, hi):
            if type(run) is PackedRun:
                events = decode_packed(run.num_rows, run.payloads, run.types, run.lengths)
                if events is not None:
                    fold_run(state, run.first_seq, events, run.last_ts_ns)
                else:                                   # names the bad payload: row by row
                    for rows in store.payload_runs(run.first_seq, run.last_seq):
                        _fold_rows(state, rows)
                n = run.num_rows
            else:
                n = _fold_rows(state, run)
            if progress is not None:
                progress(n)


def _fold_rows(state: State, run: PayloadRun | list) -> int:
    """Fold a PayloadRun, or the RawRow-shaped rows of a range with a gap; returns how many rows."""
    if type(run) is list:                               # a range with a gap: rows with their seqs
        fold_decoded(state, _decoded(run))
        return len(run)
    _fold_payload_run(state, run)
    return len(run.rows)


def _fold_payload_run(state: State, run) -> None:
    decoders = current_decoders(run.rows)
    if decoders is None:                                # an older schema somewhere: upcast row by row
        fold_run(state, run.first_seq, _decoded_run(run), run.last_ts_ns)
        return
    try:
        fold_run(state, run.first_seq, map(call, decoders, map(_payload, run.rows)), run.last_ts_ns)
    except PAYLOAD_ERRORS as e:
        # Name the first bad row exactly as the row-by-row path words it (the replay is over).
        for _ in _decoded_run(run):
            pass
        raise ReplayError(f"seqs {run.first_seq}..{run.last_seq}: a payload does not decode: {e}") from e


def _decoded_run(run):
    """Events of a PayloadRun through ``decode_event``; a payload that does not decode is named by its seq."""
    seq = run.first_seq
    for type_name, version, payload in run.rows:
        try:
            yield decode_event(payload, type_name, version)
        except DecodeError as e:
            raise ReplayError(f"seq {seq}: {e}") from e
        seq += 1


def _decoded(rows):
    """(seq, ts_ns, event) from raw rows; a payload that does not decode is named by its seq."""
    for r in rows:
        seq = r[0]
        try:
            yield seq, r[1], decode_event(r[9], r[5], r[6])
        except DecodeError as e:
            raise ReplayError(f"seq {seq}: {e}") from e


def write_snapshots(store, every: int = 100_000, progress=None) -> list[int]:
    """Fold the whole ledger once and save a snapshot every ``every`` events. Returns their seqs.

    Each snapshot is vouched for by a StateCheckpoint this appends to the ledger (producer
    ``SNAPSHOT_PRODUCER``): a snapshot the chain does not vouch for is never used (ledger.snapshots).
    """
    state, pos, saved = State(), 0, []
    last = store.last_seq()
    epoch = time.time_ns()          # a new producer epoch per run: its triples never collide
    while pos < last:
        hi = min(last, pos + every)
        _fold_range(state, store, pos + 1, hi, progress)
        pos = hi
        if pos % every == 0 or pos == last:
            digest = state_hash(state)
            env = Envelope(producer=SNAPSHOT_PRODUCER, epoch=epoch, producer_seq=len(saved) + 1, ts_ns=time.time_ns())
            [checkpoint_seq] = store.append([(env, StateCheckpoint(through_seq=pos, state_hash=digest))])
            store.save_snapshot(pos, encode_state(state), digest, checkpoint_seq)
            saved.append(pos)
    return saved


def older_checkpoints(checkpoints) -> int:
    """How many of (seq, through, hash) an earlier fold version wrote (they are not compared)."""
    return sum(1 for _seq, _through, h in checkpoints if not this_fold(h))


def check_checkpoints(store, checkpoints, progress=None) -> list[str]:
    """Fold once from zero and compare each StateCheckpoint this fold version wrote; return the
    mismatches."""
    problems: list[str] = []
    wanted = sorted((through, seq, h) for seq, through, h in checkpoints if this_fold(h))
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
