"""The events that touched one subject, in order: a block, a session, a move or a worker.

One pass over the ledger. Moves are followed through their lifecycle: once a MoveRequested
touches the subject, every later event naming that move_id (ack, failure, stranding, late ack,
a release's CopiesReleased, park) belongs to the timeline too.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import msgspec

from residency.events.envelope import Recorded

SUBJECT_KINDS = ("block", "session", "move", "worker")


class SubjectError(ValueError):
    pass


def parse_subject(text: str) -> tuple[str, str]:
    kind, sep, ident = text.partition(":")
    if not sep or kind not in SUBJECT_KINDS or not ident:
        raise SubjectError(f"subject must be one of {', '.join(k + ':ID' for k in SUBJECT_KINDS)}; got {text!r}")
    if kind == "worker" and not ident.isdigit():
        raise SubjectError(f"worker id must be an integer, got {ident!r}")
    return kind, ident


def timeline(records: Iterable[Recorded], kind: str, ident: str) -> Iterator[Recorded]:
    moves: set[str] = set()
    blocks: set[tuple[int, int]] = set()         # (worker, block id) for block subjects
    worker_id = int(ident) if kind == "worker" else None
    block_num = int(ident) if kind == "block" and ident.isdigit() else None
    for rec in records:
        e = rec.event
        env = rec.envelope
        hit = False
        move_id = getattr(e, "move_id", None)
        if move_id is not None and move_id in moves:
            hit = True
        elif kind == "move":
            hit = move_id == ident or env.causation == ident
        elif kind == "session":
            hit = env.correlation_id == ident or getattr(e, "session", None) == ident
            if hit and move_id is not None:
                moves.add(move_id)
        elif kind == "worker":
            hit = getattr(e, "worker", None) == worker_id
        elif kind == "block":
            w = getattr(e, "worker", None)
            ids = getattr(e, "blocks", None)
            if ids is not None:
                keys = getattr(e, "keys", None)
                if keys is not None:
                    for bid, key in zip(ids, keys):
                        if key == ident or bid == block_num:
                            blocks.add((w, bid))
                elif block_num is not None and block_num in ids:
                    blocks.add((w, block_num))
                hit = any((w, b) in blocks for b in ids)
                if hit and move_id is not None:
                    moves.add(move_id)
            elif getattr(e, "blocks_lost", None):
                hit = any((w, b) in blocks for b in e.blocks_lost)
        if hit:
            yield rec


def one_line(rec: Recorded, iso) -> str:
    env = rec.envelope
    fields = msgspec.structs.asdict(rec.event)
    for k in ("checksums",):
        if fields.get(k):
            fields[k] = f"[{len(fields[k]) // 8} checksums]"
    if isinstance(fields.get("blocks"), list) and len(fields["blocks"]) > 8:
        fields["blocks"] = f"[{len(fields['blocks'])} blocks: {fields['blocks'][:4]}…]"
    if isinstance(fields.get("keys"), list) and len(fields["keys"]) > 4:
        fields["keys"] = f"[{len(fields['keys'])} keys]"
    body = " ".join(f"{k}={v}" for k, v in fields.items())
    return f"{env.seq:>9}  {iso(env.ts_ns)}  {env.producer:<9} {type(rec.event).__name__:<16} {body}"
