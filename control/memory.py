"""The memory view: every byte the server holds, per worker and tier, by tenant, with what could
be given back. Pure: the folded state, the pages running requests use, the workers' probes and
pool sizings in; a ``MemoryView`` out (``GET /admin/memory``, ``residency ctl memory``, and the
reclaim path that decides what to free).

Per worker and tier:

    capacity    = the tier's KV pool (as the worker reported it) + bytes held beside it
    used        = KV bytes on the tier (the fold's books) + bytes held beside it
    beside it   device: the weights, the mover's scratch and the captured decode graphs
                        (WorkerJoined.device_owned; graphs as the probe says now, else as joined,
                        None where not measured: a CPU worker);
                host:   pinned rings, i.e. every pinned grant but the host pool's own
    hot         = bytes in use that must not move now: pages running requests read or write,
                  pages of moves in flight, and everything held beside the pool
    reclaimable = used - hot: resident KV no one is using
    pinned      = page-locked host bytes the worker registered (the host tier only)

NOTE: hotness is answered by the serving path (``busy``); when it cannot answer (``busy`` None)
every resident page counts as hot, so the view never offers a page that may be in use: refusing
to reclaim is the safe direction. A worker whose probe failed or timed out has its counters
None (unknown), never 0.

Tenants of a tier sum to its used bytes: session KV (named sessions), retained prefixes
(sessions named "~..."), KV of no session, weights, scratch, pinned rings, and outside tenants
(memory lent to other processes on the device: empty until reclaim fills it).
"""
from __future__ import annotations

import msgspec

from residency.control.state import LOST, State
from residency.events.commands import MemoryReport, PoolSizing

TIERS = ("device", "host", "disk")
HOST_POOL_OWNER = "host-pool"     # the host pool's own grant: its bytes are the host tier's capacity


class Tenants(msgspec.Struct, kw_only=True):
    session_kv: int = 0
    retained_prefixes: int = 0
    unowned_kv: int = 0                # blocks of no session (operator commits)
    weights: int = 0
    scratch: int = 0
    graphs: int | None = None          # captured CUDA graphs' memory (None: not measured, e.g. on CPU)
    pinned_rings: int = 0
    outside: dict[str, int] = {}       # tenant -> bytes lent to it (reclaim)

    def total(self) -> int:
        return (self.session_kv + self.retained_prefixes + self.unowned_kv + self.weights + self.scratch
                + (self.graphs or 0) + self.pinned_rings + sum(self.outside.values()))


class TierView(msgspec.Struct, kw_only=True):
    capacity_bytes: int
    used_bytes: int
    hot_bytes: int
    reclaimable_bytes: int
    pinned_bytes: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    num_blocks: int
    num_hot_blocks: int
    hotness_known: bool
    tenants: Tenants


class Probe(msgspec.Struct, kw_only=True):
    """A worker's counters as it read them; every field None when it did not answer."""

    answered: bool
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None
    allocator_allocated_bytes: int | None = None
    allocator_reserved_bytes: int | None = None
    pinned_in_use_bytes: int | None = None
    pinned_limit_bytes: int | None = None


class WorkerView(msgspec.Struct, kw_only=True):
    worker: int
    device: str
    alive: bool
    block_bytes: int
    tiers: dict[str, TierView]
    probe: Probe
    sizing: dict | None = None         # the worker's PoolSizing, by field (how the pool got its size)
    weights: str = ""                  # its weights arena: the model served, asleep, or stranded ("": none)


class MemoryView(msgspec.Struct, kw_only=True):
    last_seq: int
    workers: list[WorkerView]
    outside_tenants: dict[str, int] = {}    # every worker's lent bytes by tenant (reclaim)


def probe_of(report: MemoryReport | None) -> Probe:
    if report is None:
        return Probe(answered=False)
    return Probe(answered=True, device_total_bytes=report.device_total_bytes,
                 device_free_bytes=report.device_free_bytes,
                 allocator_allocated_bytes=report.allocator_allocated_bytes,
                 allocator_reserved_bytes=report.allocator_reserved_bytes,
                 pinned_in_use_bytes=report.pinned_in_use_bytes, pinned_limit_bytes=report.pinned_limit_bytes)


def moving_blocks(state: State, worker: int) -> dict[str, set[int]]:
    """tier -> blocks of ``worker`` a move in flight reads or writes there."""
    out: dict[str, set[int]] = {t: set() for t in TIERS}
    for mv in state.inflight.values():
        if mv.worker == worker and mv.status != LOST:
            out[mv.src].update(mv.blocks)
            out[mv.dst].update(mv.blocks)
    return out


def worker_view(state: State, worker: int, busy: set[int] | None, report: MemoryReport | None,
                sizing: PoolSizing | None = None) -> WorkerView:
    ws = state.workers[worker]
    bb = ws.block_bytes
    moving = moving_blocks(state, worker)
    per_tier = {t: Tenants() for t in TIERS}
    counts = {t: 0 for t in TIERS}
    hot_counts = {t: 0 for t in TIERS}
    for bid, b in state.blocks.get(worker, {}).items():
        for t in b.tiers:
            ten = per_tier[t]
            if b.session is None:
                ten.unowned_kv += bb
            elif b.session.startswith("~"):
                ten.retained_prefixes += bb
            else:
                ten.session_kv += bb
            counts[t] += 1
            if bid in moving[t] or (t == "device" and (busy is None or bid in busy)):
                hot_counts[t] += 1
    arena = state.arenas.get(f"{worker}:weights")
    # an arena asleep gave its device bytes back (level 1: its image is in a pinned grant on host)
    per_tier["device"].weights = 0 if arena is not None and arena.asleep else ws.device_owned.get("weights", 0)
    per_tier["device"].scratch = sum(v for k, v in ws.device_owned.items() if k not in ("weights", "graphs"))
    # the decode graphs are captured again after start (a pool resize, a flip, a wake) and dropped on a
    # sleep, with no event: an answered probe carries the worker's books as they are now; without one,
    # the figure the worker joined with. Absent either way: none held or not measured (None, never 0)
    owned = report.device_owned if report is not None else ws.device_owned
    per_tier["device"].graphs = owned.get("graphs")
    per_tier["host"].pinned_rings = sum(v for k, v in ws.pinned.items() if k != HOST_POOL_OWNER)
    # lent to outside tenants (reclaim): the device's bytes, held by another process, never ours to free
    per_tier["device"].outside = dict(ws.tenants)
    tiers = {}
    for t in TIERS:
        acc = ws.tiers.get(t)
        kv_cap, kv_used = (acc.capacity_bytes, acc.used_bytes) if acc is not None else (0, 0)
        ten = per_tier[t]
        beside = ten.weights + ten.scratch + (ten.graphs or 0) + ten.pinned_rings + sum(ten.outside.values())
        # the fold's used is the truth; blocks the walk above could not place are shown apart
        ten.unowned_kv += kv_used - counts[t] * bb
        hot = hot_counts[t] * bb + beside
        used = kv_used + beside
        tiers[t] = TierView(capacity_bytes=kv_cap + beside, used_bytes=used, hot_bytes=hot,
                            reclaimable_bytes=max(used - hot, 0),
                            pinned_bytes=sum(ws.pinned.values()) if t == "host" else 0,
                            kv_capacity_bytes=kv_cap, kv_used_bytes=kv_used, num_blocks=counts[t],
                            num_hot_blocks=hot_counts[t], hotness_known=busy is not None or t != "device",
                            tenants=ten)
    return WorkerView(worker=worker, device=ws.device, alive=ws.alive, block_bytes=bb, tiers=tiers,
                      probe=probe_of(report),
                      sizing=msgspec.structs.asdict(sizing) if sizing is not None else None,
                      weights=_weights(arena))


def _weights(arena) -> str:
    if arena is None:
        return ""
    if arena.stranded:
        return f"STRANDED by {arena.stranded}: {arena.stranded_bytes} bytes of image unknown until a complete flip or wake"
    if arena.flip_in_flight:
        return f"{arena.action or 'flip'} {arena.flip_in_flight} in flight ({arena.model!r} -> {arena.incoming_model!r})"
    if arena.asleep:
        return f"asleep (level {arena.sleep_level}), {arena.model!r} to wake, gen {arena.gen}"
    return f"serving {arena.model!r}, gen {arena.gen}"


def memory_view(state: State, busy: dict[int, set[int]] | None, reports: dict[int, MemoryReport | None],
                sizings: dict[int, PoolSizing | None] | None = None) -> MemoryView:
    """The view of every live worker. ``busy``: worker -> pages running requests use (None: the
    serving path could not say: all resident device pages are hot). ``reports``: each worker's
    probe, None for one that did not answer."""
    sizings = sizings or {}
    workers = [worker_view(state, w, None if busy is None else busy.get(w, set()), reports.get(w), sizings.get(w))
               for w, ws in sorted(state.workers.items()) if ws.alive]
    outside: dict[str, int] = {}
    for wv in workers:
        for tenant, nbytes in wv.tiers["device"].tenants.outside.items():
            outside[tenant] = outside.get(tenant, 0) + nbytes
    return MemoryView(last_seq=state.last_seq, workers=workers, outside_tenants=outside)


def to_json(view: MemoryView) -> bytes:
    return msgspec.json.encode(view)
