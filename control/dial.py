"""The dial: a worker's device pool resized live, every reader of it rebound all or none. Pure.

    AskResize ──validate──► invalid (another tier, no such worker, under one block): the reason,
              │             nothing recorded
              ├─plan──────► refused: below the floor, another resize running, host cannot take
              │             what must leave ─► MoveRefused{asked, available, floor} and nothing
              │             changes (never retried smaller)
              │           ► evictions: the coldest idle device blocks that will not fit go to host
              │             (MoveRequested ... MoveAcked; a block already on host only loses its
              │             device copy)
              └─rebind────► RebindRequested{from_gen, to_gen, readers}, committed BEFORE ResizePool
                            PoolRebound ─► ReaderStamped per worker reader at to_gen,
                                           PoolResized{measured_freed_bytes},
                                           ReaderStamped per control reader (the scheduler, once
                                           it sees the new capacity),
                                           RebindCommitted (all at to_gen) | RebindTorn{readers_behind}
                                       ─► error: RebindRefused (nothing changed; usable at from_gen)
                            no answer by the deadline ─► RebindTorn naming every reader

The floor of a pool is what cannot leave it: the budget's floor (headroom no move may take) plus
the pages that running requests and unsettled moves hold, plus bytes in flight toward it.

The context floor of a serving pool is one sequence of the whole context: ceil(max_context /
page_tokens) pages. A shrink that ends below it is refused (a request of the full context could
never be seated again), unless the shrink is a sleep's: the model leaves the device with it and
its wake grows the pool back. A resize to the same size or larger always passes it (a pool
started smaller with ``--device-blocks`` can still be repaired in place or grown).

A tensor-parallel group's pool is resized as one: the leader's plan, one rebind per rank, and
``verdicts`` commits every rank's rebind or tears every rank that resized (docs/groups.md).

A pool is *closed* while a rebind of it is requested (in progress) or torn: the scheduler places
no request on it and no move goes into or out of it (``closed``), until a later complete rebind
commits (``ctl resize`` to the same size rebinds in place).
"""
from __future__ import annotations

import msgspec

from residency.events import catalog as ev
from residency.events.commands import PoolRebound
from residency.control.budget import Refusal
from residency.control.policy.proposals import Proposal, split_for_destination
from residency.control.policy.recency import Recency
from residency.control.state import RebindState, State

DEVICE = "device"
SCHEDULER = "scheduler"       # the control's reader of every device pool: capacity and block tables
OPEN = ("requested", "torn")
# rebinds that changed nothing (refused by the worker) or whose pool died with its worker
# (superseded) never decide whether a pool is usable
_NOT_DECIDING = ("refused", "superseded")


class InvalidResize(ValueError):
    """A resize that names nothing resizable; nothing is recorded, the asker gets the reason."""


class ContextFloor(msgspec.Struct, frozen=True, kw_only=True):
    """The pages one sequence of the whole context takes on a serving worker's pool."""

    max_context: int                  # positions (prompt + completion) of the longest model it serves
    page_tokens: int

    @property
    def pages(self) -> int:
        return -(-self.max_context // self.page_tokens)


class ResizePlan(msgspec.Struct, frozen=True, kw_only=True):
    worker: int
    tier: str
    from_bytes: int
    to_bytes: int
    num_slots: int
    evict: list[Proposal]           # the moves out that must be acked before the rebind
    num_held: int                   # pages the pool holds now (used, in flight toward it, reserved)


def rebind_id(epoch: int, n: int) -> str:
    """Unique across restarts: the control epoch is part of it."""
    return f"rb-{epoch:x}-{n}"


# ------------------------------------------------------------------ is the pool usable?
def open_rebind(state: State, worker: int, pool: str = DEVICE) -> RebindState | None:
    """The rebind that closes ``worker``'s ``pool``: the last one that decides, when it is still
    requested or was torn (a later committed rebind repairs a torn one)."""
    last = None
    for rb in state.rebinds.values():
        if rb.worker == worker and rb.pool == pool and rb.status not in _NOT_DECIDING:
            last = rb
    return last if last is not None and last.status in OPEN else None


def behind(rb: RebindState) -> list[str]:
    return sorted(r for r, g in rb.readers.items() if g != rb.to_gen)


def closed(state: State, worker: int, tier: str = DEVICE) -> tuple[str, str] | None:
    """(code, reason) when ``worker``'s ``tier`` pool takes no request and no move, else None."""
    if tier != DEVICE:
        return None
    rb = open_rebind(state, worker, tier)
    if rb is None:
        return None
    if rb.status == "torn":
        return ("pool_torn", f"the device pool of worker {worker} is torn: rebind {rb.rebind_id} "
                             f"(gen {rb.from_gen}->{rb.to_gen}) left readers {behind(rb)} behind; "
                             f"a complete resize repairs it (e.g. `residency ctl resize` to its size)")
    return ("pool_rebinding", f"the device pool of worker {worker} is being rebound by {rb.rebind_id} "
                              f"(gen {rb.from_gen}->{rb.to_gen})")


def torn_pools(state: State) -> list[str]:
    """A line per torn pool, for /health and status."""
    out = []
    for w in sorted(state.workers):
        why = closed(state, w)
        if why is not None and why[0] == "pool_torn":
            out.append(why[1])
    return out


# ------------------------------------------------------------------ the plan
def validate(state: State, worker: int, tier: str, nbytes: int) -> tuple[int, int]:
    """(num_slots, to_bytes) of a resize, or InvalidResize naming why it is not one."""
    ws = state.workers.get(worker)
    if ws is None or not ws.alive:
        raise InvalidResize(f"worker {worker} is not serving")
    if tier != DEVICE:
        raise InvalidResize(f"only the device pool can be resized: the {tier} tier is sized at start "
                            f"(its copies would need another move machinery to leave a shrinking range)")
    bb = ws.block_bytes
    if bb <= 0:
        raise InvalidResize(f"worker {worker} has no block size")
    if nbytes < bb:
        raise InvalidResize(f"{nbytes} bytes is less than one block ({bb} bytes) of worker {worker}")
    num_slots = nbytes // bb
    return num_slots, num_slots * bb


def below_context(state: State, worker: int, num_slots: int, context: ContextFloor | None) -> Refusal | None:
    """The refusal of a shrink of ``worker``'s device pool to ``num_slots`` pages that ends below
    one sequence of the whole context; None when it does not (or the worker serves no model)."""
    ws = state.workers[worker]
    bb, acc = ws.block_bytes, ws.tiers[DEVICE]
    from_slots = acc.capacity_bytes // bb
    if context is None or num_slots >= context.pages or num_slots >= from_slots:
        return None
    floor = context.pages * bb
    return Refusal(worker=worker, tier=DEVICE, asked_bytes=num_slots * bb, available_bytes=acc.capacity_bytes,
                   floor_bytes=floor, ceiling_bytes=acc.capacity_bytes, used_bytes=acc.used_bytes,
                   inflight_bytes=acc.inflight_in_bytes,
                   reason=(f"resize of the device pool of worker {worker} to {num_slots * bb} ({num_slots} pages) < "
                           f"context floor {floor} = ceil(max_context {context.max_context} / page_tokens "
                           f"{context.page_tokens}) = {context.pages} pages x {bb}: a sequence of the whole "
                           f"context could not be seated (only a sleep shrinks a pool below it)"))


def plan(state: State, recency: Recency, origin: str, worker: int, tier: str, nbytes: int,
         in_use: set[int], context: ContextFloor | None = None) -> ResizePlan | Refusal:
    """What resizing ``worker``'s pool to ``nbytes`` takes, or the refusal with its arithmetic.

    ``in_use``: pages running requests read or write (never moved); those not written yet hold
    room in the pool all the same (reserved). ``context``: the serving worker's context floor, which
    a shrink may not go below (None: not checked, as for a sleep's shrink or a worker with no model)."""
    num_slots, to_bytes = validate(state, worker, tier, nbytes)
    refused = below_context(state, worker, num_slots, context)
    if refused is not None:
        return refused
    ws = state.workers[worker]
    bb, acc = ws.block_bytes, ws.tiers[DEVICE]
    from_bytes = acc.capacity_bytes
    wb = state.blocks.get(worker, {})
    reserved_pages = sum(1 for b in in_use if b not in wb)
    moving: set[int] = set()
    for mv in (*state.inflight.values(), *state.stranded.values()):
        if mv.worker == worker:
            moving.update(mv.blocks)
    on_device = [b for b, st in wb.items() if DEVICE in st.tiers]
    stuck = [b for b in on_device if b in in_use or b in moving]
    inflight_pages = -(-acc.inflight_in_bytes // bb)
    floor = acc.floor_bytes + (len(stuck) + reserved_pages + inflight_pages) * bb
    if to_bytes < floor:
        return Refusal(worker=worker, tier=DEVICE, asked_bytes=to_bytes, available_bytes=from_bytes,
                       floor_bytes=floor, ceiling_bytes=from_bytes, used_bytes=acc.used_bytes,
                       inflight_bytes=acc.inflight_in_bytes,
                       reason=(f"resize of the device pool of worker {worker} to {to_bytes} < floor {floor} = "
                               f"budget floor {acc.floor_bytes} + ({len(stuck)} pages held by running requests "
                               f"or moves + {reserved_pages} reserved for running requests + {inflight_pages} in "
                               f"flight toward it) x {bb}"))
    num_held = len(on_device) + reserved_pages + inflight_pages
    excess = num_held - num_slots
    evict: list[Proposal] = []
    if excess > 0:
        stuck_set = set(stuck)
        cands = sorted((b for b in on_device if b not in stuck_set), key=lambda b: recency.last_used(worker, b))
        chosen = cands[:excess]
        if len(chosen) < excess:     # the floor check above makes this unreachable unless the books disagree
            return Refusal(worker=worker, tier=DEVICE, asked_bytes=to_bytes, available_bytes=from_bytes,
                           floor_bytes=floor, ceiling_bytes=from_bytes, used_bytes=acc.used_bytes,
                           inflight_bytes=acc.inflight_in_bytes,
                           reason=f"{excess} pages must leave the device of worker {worker}, only {len(chosen)} may")
        evict = split_for_destination(state, origin, "evict", worker, DEVICE, "host", chosen, False, None,
                                      f"resize: device pool of worker {worker} {from_bytes} -> {to_bytes}")
    return ResizePlan(worker=worker, tier=DEVICE, from_bytes=from_bytes, to_bytes=to_bytes, num_slots=num_slots,
                      evict=evict, num_held=num_held)


def busy_refusal(state: State, worker: int, to_bytes: int, running: str) -> Refusal:
    """Another resize of the same pool is running: this one is refused whole."""
    acc = state.workers[worker].tiers[DEVICE]
    return Refusal(worker=worker, tier=DEVICE, asked_bytes=to_bytes, available_bytes=acc.capacity_bytes,
                   floor_bytes=0, ceiling_bytes=acc.capacity_bytes, used_bytes=acc.used_bytes,
                   inflight_bytes=acc.inflight_in_bytes,
                   reason=f"resize of the device pool of worker {worker} refused: {running} is still running")


# ------------------------------------------------------------------ the rebind
def requested(state: State, rid: str, worker: int, from_gen: int, control_readers: list[str],
              worker_readers: list[str]) -> ev.RebindRequested:
    """The write-ahead record of a rebind: every reader, the control's first, each at from_gen.
    The next gen is above every gen this worker's pool has had in the ledger (a rebind that never
    answered may have moved it)."""
    seen = [rb.to_gen for rb in state.rebinds.values()
            if rb.worker == worker and rb.pool == DEVICE and rb.status != "superseded"]   # not the weights arena's
    to_gen = max([from_gen] + seen) + 1
    readers = list(dict.fromkeys([*control_readers, *worker_readers]))
    return ev.RebindRequested(rebind_id=rid, worker=worker, pool=DEVICE, from_gen=from_gen, to_gen=to_gen,
                              readers=readers)


def worker_answer(req: ev.RebindRequested, ans: PoolRebound) -> list[ev.Event]:
    """What a worker's answer records before the control's readers stamp: a refusal closes the
    rebind with nothing changed; otherwise a stamp per worker reader that reached to_gen, then
    the resize with what the worker measured."""
    if ans.error:
        return [ev.RebindRefused(rebind_id=req.rebind_id, worker=req.worker, error=ans.error)]
    out: list[ev.Event] = [ev.ReaderStamped(rebind_id=req.rebind_id, reader=r, gen=req.to_gen)
                           for r in req.readers if ans.stamps.get(r) == req.to_gen and r not in ans.refused]
    out.append(ev.PoolResized(worker=req.worker, pool=req.pool, from_bytes=ans.from_bytes, to_bytes=ans.to_bytes,
                              gen=req.to_gen, measured_freed_bytes=ans.measured_freed_bytes))
    return out


def verdict(req: ev.RebindRequested, stamped: set[str]) -> ev.RebindCommitted | ev.RebindTorn:
    """Committed only when every reader carries to_gen; else torn, naming those behind."""
    late = [r for r in req.readers if r not in stamped]
    if late:
        return ev.RebindTorn(rebind_id=req.rebind_id, readers_behind=late)
    return ev.RebindCommitted(rebind_id=req.rebind_id)


def rank_rebind_id(rid: str, rank: int, num_ranks: int) -> str:
    """The rebind id of one rank's pool in a resize of ``num_ranks`` pools (a worker alone: ``rid``)."""
    return rid if num_ranks == 1 else f"{rid}.r{rank}"


def verdicts(reqs: list[ev.RebindRequested], answers: dict[str, set[str] | str | None]) -> list[ev.Event]:
    """The verdicts of one resize of the pools of every rank of a group (a worker alone: one rank),
    once every rank answered or its answer is given up on (``answers`` by rebind id).

    All or torn: a rank's pool counts as rebound only when EVERY rank's pool is, because the ranks
    hold shards of the same block ids and one rank at another size (or with a reader behind) would
    seat or move what its peers cannot. So when every rank stamped every reader, a RebindCommitted
    per rank; when every rank refused, nothing (each RebindRefused is recorded with its answer:
    no pool changed); otherwise a RebindTorn for every rank that resized or did not answer, naming
    its own readers behind and each peer's shortfall (``worker W: reader`` / ``worker W: refused``),
    which closes the group's pool until a complete group resize commits."""
    short: dict[str, list[str]] = {}
    for req in reqs:
        a = answers.get(req.rebind_id)
        if isinstance(a, str):
            short[req.rebind_id] = ["refused"]
        else:
            short[req.rebind_id] = [r for r in req.readers if a is None or r not in a]
    if all(isinstance(answers.get(req.rebind_id), str) for req in reqs):
        return []
    if not any(short.values()):
        return [ev.RebindCommitted(rebind_id=req.rebind_id) for req in reqs]
    out: list[ev.Event] = []
    for req in reqs:
        if isinstance(answers.get(req.rebind_id), str):
            continue
        peers = [f"worker {p.worker}: {r}" for p in reqs if p is not req for r in short[p.rebind_id]]
        out.append(ev.RebindTorn(rebind_id=req.rebind_id, readers_behind=short[req.rebind_id] + peers))
    return out


def unanswered(req: ev.RebindRequested) -> ev.RebindTorn:
    """No answer by the deadline (or the worker went): nobody is known to be at to_gen."""
    return ev.RebindTorn(rebind_id=req.rebind_id, readers_behind=list(req.readers))


def torn_at_recovery(state: State) -> list[ev.RebindTorn]:
    """After a control restart: a rebind requested and never answered is torn, its readers
    unknown, so a crashed control never leaves a pool silently trusted."""
    return [ev.RebindTorn(rebind_id=rb.rebind_id, readers_behind=sorted(rb.readers))
            for rb in state.rebinds.values() if rb.status == "requested"]


def refuse_moves(state: State, proposals: list[Proposal], holds=None) -> Refusal | None:
    """The refusal of moves into or out of a closed device pool (a rebind in progress, or torn),
    naming the rebind; releases pass (they free pages, and a finished request must not keep its
    pages held). None when every move may go. ``holds(worker)``: (code, reason) of a pool held
    closed for a reason the state does not show yet (a resize moving blocks out first)."""
    for p in proposals:
        if p.is_release or DEVICE not in (p.src, p.dst):
            continue
        why = holds(p.worker) if holds is not None else closed(state, p.worker)
        if why is not None:
            acc = state.workers[p.worker].tiers[p.dst]
            asked = len(p.blocks) * state.workers[p.worker].block_bytes
            return Refusal(worker=p.worker, tier=p.dst, asked_bytes=asked, available_bytes=0,
                           floor_bytes=acc.floor_bytes, ceiling_bytes=acc.capacity_bytes, used_bytes=acc.used_bytes,
                           inflight_bytes=acc.inflight_in_bytes,
                           reason=f"{why[0]}: no move goes into or out of the device pool of worker {p.worker}: {why[1]}")
    return None
