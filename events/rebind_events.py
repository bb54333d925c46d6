"""Device memory bound anew under its readers: a pool's rebind and resize (every reader stamps the
new generation or the rebind is torn), the weights arena's loads and flips (sleep, wake, another
model), and the device bytes an outside tenant is granted and gives back (a shrink and a grow of
the pool, each a rebind).

NOTE: a new field goes at the end of its class, with a default (``events.event`` says why); a new
class joins the union in ``events.catalog``.
"""
from __future__ import annotations

from residency.events.event import Event


# ---------------------------------------------------------------- rebind
class RebindRequested(Event):
    rebind_id: str
    worker: int
    pool: str
    from_gen: int
    to_gen: int
    readers: list[str]


class ReaderStamped(Event):
    rebind_id: str
    reader: str
    gen: int


class RebindCommitted(Event):
    rebind_id: str


class RebindTorn(Event):
    rebind_id: str
    readers_behind: list[str]


class PoolResized(Event):
    worker: int
    pool: str
    from_bytes: int
    to_bytes: int
    gen: int
    # what the driver counts free after the resize less before (a grow: negative), as the worker
    # measured it; None: not measurable there (a CPU host), never 0 for "unknown"
    measured_freed_bytes: int | None = None


class RebindRefused(Event):
    """The pool's worker refused a rebind and changed nothing (``error`` says why, with its
    arithmetic: e.g. more than the card holds): the pool and every reader stay at ``from_gen``,
    usable. Closes the rebind without tearing it."""

    rebind_id: str
    worker: int
    error: str


# ---------------------------------------------------------------- weights and flip
class WeightsLoaded(Event):
    worker: int
    arena: str
    model: str
    bytes: int                         # the parameter tensors' nbytes, summed
    allocator_bytes: int | None = None  # the device allocator's growth over the load (None: not measured)
    # bytes of this model's image by tier ("device": in the arena, "host": a pinned image, "file": only
    # on disk) and the image's checksum (dataplane/flip/image.py ImageSums.total, hex; "" not computed)
    tier_bytes: dict[str, int] = {}
    checksum: str = ""


class FlipRequested(Event):
    """Written ahead of a ``SwapWeights`` command. ``action``: "flip" (the arena's image becomes
    ``to_model``), "sleep" (``to_model`` "": level 1 moves the image to pinned host, level 2 drops it)
    or "wake" (``from_model`` "": the image comes back from host, or from its file after a level-2
    sleep). Bytes are what the plan expects to move each way."""

    flip_id: str
    worker: int
    arena: str
    from_model: str
    to_model: str
    bytes_out: int
    bytes_in: int
    action: str = "flip"
    level: int = 0
    to_gen: int = 0
    deadline_ns: int = 0
    # a sleep: the worker's device KV pool bytes before the sleep shrank it, the size the wake grows
    # it back to (in the ledger so that a control restarted while asleep still knows it); None: the
    # sleep did not shrink the pool
    kv_pool_bytes: int | None = None


class FlipCompleted(Event):
    """What the worker measured (``WeightsSwapped``): bytes each way, overlap, wall time, both
    images' checksums. ``measured_freed_bytes``: device bytes the driver counts free afterwards less
    before (a sleep: positive, a wake: negative; None where not measurable, e.g. a CPU host)."""

    flip_id: str
    bytes_out: int
    bytes_in: int
    started_ns: int
    finished_ns: int
    overlapped_steps: int
    checksum_ok: bool
    worker: int = -1
    to_gen: int = 0
    dropped_bytes: int = 0
    steps: int = 0
    out_ns: int = 0
    in_ns: int = 0
    measured_freed_bytes: int | None = None


class FlipFailed(Event):
    """The flip did not happen, or was refused before a byte moved (``error`` with its arithmetic),
    or was abandoned (``stranded``: the worker died or missed the deadline; ``stranded_bytes``
    names the arena bytes whose image is then unknown, never 0 for unknown)."""

    flip_id: str
    error: str
    stranded: bool = False
    stranded_bytes: int | None = None


# ---------------------------------------------------------------- outside tenants
class TenantReclaimed(Event):
    """An outside tenant was granted device memory: the moves ``moves`` emptied pool slots (the
    sessions ``sessions`` parked or dropped), then the dial shrank the device pool by
    ``granted_bytes`` (the ask, ``asked_bytes``, rounded up to whole pages) in rebind
    ``rebind_id``. ``freed_bytes``: device bytes the moves' answers said they freed (0 when the
    pool already had the room). ``measured_bytes``: what the driver counted free after the
    shrink less before (None: not measured, e.g. on a CPU host; never a guess)."""

    tenant: str
    worker: int
    asked_bytes: int
    granted_bytes: int
    freed_bytes: int
    measured_bytes: int | None
    rebind_id: str
    moves: list[str] = []
    sessions: list[str] = []


class TenantReclaimFailed(Event):
    """A reclaim that passed its arithmetic but did not end in a grant: a move it needed failed,
    was refused or stranded, or the dial refused the shrink. Nothing was granted; what moved
    stays where it landed (its own events say so). Also a release whose grow the dial did not
    commit (``reason`` starts with "release:"): the grant stays the tenant's. ``stranded_bytes``/``stranded_moves``: bytes
    at risk on the way, named, never counted as freed."""

    tenant: str
    worker: int
    asked_bytes: int
    reason: str
    moves: list[str] = []
    stranded_bytes: int = 0
    stranded_moves: list[str] = []


class TenantReleased(Event):
    """An outside tenant gave back ``bytes`` of its grant; the dial grew the device pool by them
    in rebind ``rebind_id``. ``measured_bytes``: what the driver counted taken by the grow (None:
    not measured)."""

    tenant: str
    worker: int
    bytes: int
    measured_bytes: int | None
    rebind_id: str


__all__ = [
    "RebindRequested", "ReaderStamped", "RebindCommitted", "RebindTorn", "PoolResized",
    "RebindRefused", "WeightsLoaded", "FlipRequested", "FlipCompleted", "FlipFailed",
    "TenantReclaimed", "TenantReclaimFailed", "TenantReleased",
]
