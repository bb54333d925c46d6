"""The fold of outside tenants' grants: what each worker gave away of its device memory and to
whom. Deterministic, no I/O, never raises (an anomaly is noted instead); ``control.fold``
dispatches here. The pool's capacity itself changes with ``PoolResized`` (the dial's); these
events only say whose the difference is."""
from __future__ import annotations

from typing import Callable

from residency.events import catalog as ev
from residency.control.fold_base import anomaly as _anomaly, worker_or_anomaly as _worker
from residency.control.state import State


def _reclaimed(s: State, e: ev.TenantReclaimed, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "TenantReclaimed")
    if ws is None:
        return
    if e.granted_bytes <= 0:
        _anomaly(s, seq, f"TenantReclaimed grants {e.tenant} {e.granted_bytes} bytes")
        return
    ws.tenants[e.tenant] = ws.tenants.get(e.tenant, 0) + e.granted_bytes


def _released(s: State, e: ev.TenantReleased, seq: int) -> None:
    ws = _worker(s, e.worker, seq, "TenantReleased")
    if ws is None:
        return
    held = ws.tenants.get(e.tenant, 0)
    if e.bytes <= 0 or e.bytes > held:
        _anomaly(s, seq, f"TenantReleased gives back {e.bytes} bytes of {e.tenant}, which holds {held} on worker "
                         f"{e.worker}")
        return
    if held - e.bytes:
        ws.tenants[e.tenant] = held - e.bytes
    else:
        del ws.tenants[e.tenant]


HANDLERS: dict[type, Callable[[State, object, int], None]] = {
    ev.TenantReclaimed: _reclaimed,
    ev.TenantReleased: _released,
    # TenantReclaimFailed changes nothing: the moves it names changed what they changed
}
