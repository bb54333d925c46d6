"""Denormalized audit columns, extracted from each event at append time.

The payload is the truth; these columns copy a few of its fields out so an auditor can answer
"how many bytes, where, by whom" in plain SQL (and so the audit views can join on an index):

    move_id  worker  session  tier  kind  bytes

``kind`` is the event's category where it has one: the move kind on ``MoveRequested``, the free
reason on ``BlocksFreed`` ("release" on ``CopiesReleased``, as the BlocksFreed of a release in older
ledgers), the ``why`` of a stranding or abandonment, the worker's answer on ``MoveLateFailed``, the
reason of a lost worker.
``bytes`` is the byte count the audit definitions sum for that event (e.g. ``bytes_freed_src`` on
an ack, ``bytes_at_risk`` on a stranding). ``None`` means "this event has no such field", never 0;
a ``MoveFailed`` that did not measure its bytes stays ``None``.

They are not part of the hash chain (``ledger.chain``), so ``verify`` re-extracts them from every
decoded payload and names the first seq whose stored columns differ.

NOTE: verify extracts from the event as decoded today, i.e. after any upcast, while the columns of
a row stored under an older schema were extracted from the event as it was then; an upcast may fill
a field the old event lacked (BlocksFreed v1 had no tier). So a row at its type's current schema
must match exactly, and an older row's columns must each be NULL or the upcast value. An upcaster
must not change a value an older event had, or a sound old row reads as edited.
"""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as c

Columns = tuple  # (move_id, worker, session, tier, kind, bytes)
NONE: Columns = (None, None, None, None, None, None)
NAMES = ("move_id", "worker", "session", "tier", "kind", "bytes")

_EXTRACT: dict[type, Callable[[c.Event], Columns]] = {
    # moves
    c.MoveRequested: lambda e: (e.move_id, e.worker, e.session, e.src, e.kind, e.bytes_planned),
    c.MoveDispatched: lambda e: (e.move_id, e.worker, None, None, None, None),
    c.MoveAcked: lambda e: (e.move_id, e.worker, None, None, None, e.bytes_freed_src),
    c.MoveLateAcked: lambda e: (e.move_id, e.worker, None, None, None, e.bytes_freed_src),
    c.MoveFailed: lambda e: (e.move_id, e.worker, None, None, None, e.bytes_moved),
    c.MoveRejected: lambda e: (e.move_id, e.worker, None, None, None, e.asked_bytes),
    c.MoveRefused: lambda e: (None, e.worker, e.session, e.tier, None, e.asked_bytes),
    c.MoveStranded: lambda e: (e.move_id, e.worker, None, None, e.why, e.bytes_at_risk),
    c.MoveAbandoned: lambda e: (e.move_id, e.worker, None, None, e.why, None),
    c.CopiesReleased: lambda e: (e.move_id, e.worker, e.session, e.tier, "release", e.bytes),
    c.MoveLateFailed: lambda e: (e.move_id, e.worker, None, None, e.answer, None),
    # blocks
    c.BlocksCommitted: lambda e: (None, e.worker, e.session, e.tier, None, e.bytes),
    c.BlocksFreed: lambda e: (None, e.worker, None, e.tier, e.reason, e.bytes),
    # workers and budgets
    c.WorkerJoined: lambda e: (None, e.worker, None, None, None, None),
    c.WorkerHeartbeatMissed: lambda e: (None, e.worker, None, None, None, None),
    c.WorkerLost: lambda e: (None, e.worker, None, None, e.reason, e.bytes_lost),
    c.WorkerWedged: lambda e: (None, e.worker, None, None, None, None),
    c.WorkerResumed: lambda e: (None, e.worker, None, None, None, None),
    c.BudgetSet: lambda e: (None, e.worker, None, e.tier, None, None),
    c.PinnedRegistered: lambda e: (None, e.worker, None, None, None, e.bytes),
    c.PinnedReleased: lambda e: (None, e.worker, None, None, None, e.bytes),
    # sessions and requests
    c.SessionParked: lambda e: (e.move_id, e.worker, e.session, e.tier, None, e.bytes),
    c.SessionRestored: lambda e: (e.move_id, e.worker, e.session, None, None, None),
    c.SessionDeleted: lambda e: (None, e.worker, e.session, None, None, None),    # its bytes are the releases'
    c.RequestAdmitted: lambda e: (None, None, e.session, None, None, None),
    c.RequestQueued: lambda e: (None, e.worker, e.session, None, None, None),
    # steps, pools, weights
    c.StepCompleted: lambda e: (None, e.worker, None, None, None, None),
    c.RebindRequested: lambda e: (None, e.worker, None, None, None, None),
    c.PoolResized: lambda e: (None, e.worker, None, None, None, e.to_bytes),
    c.RebindRefused: lambda e: (None, e.worker, None, None, None, None),
    c.WeightsLoaded: lambda e: (None, e.worker, None, None, None, e.bytes),
    c.FlipRequested: lambda e: (None, e.worker, None, None, None, e.bytes_in),
    # outside tenants: ``kind`` is the tenant's name, ``bytes`` what its grant changed by
    c.TenantReclaimed: lambda e: (None, e.worker, None, "device", e.tenant, e.granted_bytes),
    c.TenantReclaimFailed: lambda e: (None, e.worker, None, "device", e.tenant, None),
    c.TenantReleased: lambda e: (None, e.worker, None, "device", e.tenant, e.bytes),
    # an offloaded MoE model: ``bytes`` the expert bytes the step copied onto the device
    c.ExpertsMoved: lambda e: (None, e.worker, None, "device", "experts", e.fetched_bytes),
}


def _none(_event: c.Event) -> Columns:
    return NONE


def extractor(cls: type) -> Callable[[c.Event], Columns]:
    """The function that extracts the audit columns of events of class ``cls``."""
    return _EXTRACT.get(cls, _none)


def columns_of(event: c.Event) -> Columns:
    """The audit columns of ``event`` (all ``None`` for events that have none)."""
    return extractor(type(event))(event)
