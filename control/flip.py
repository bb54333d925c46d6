"""Flips of a worker's weights arena, from ask to verdict: the pure steps (the loop's side is
control/flipping.py). A flip is a rebind of every reader of the arena (pool "weights").

    AskFlip ──check──► invalid: no such worker, no arena, unknown model (with the list), a bad
            │          level: the reason, nothing recorded
            ├────────► refused: a flip already runs there, sleep while asleep, wake while awake,
            │          a flip to the model already resident, a flip while asleep
            │          ─► MoveRefused naming it, and nothing else
            └─plan───► FlipPlan (bytes each way), then, once the worker's requests ended and its
                       sessions' device pages are parked (the shell does that):
                       FlipRequested + RebindRequested{pool weights, from_gen, to_gen,
                       readers [router, worker]}, committed BEFORE SwapWeights
                       WeightsSwapped ─► error: FlipFailed(the worker's error verbatim),
                                                RebindRefused (nothing changed)
                                      ─► ok: ReaderStamped(worker), FlipCompleted(measured),
                                             ReaderStamped(router), RebindCommitted
                                      ─► checksum not ok, or a reader refused or behind:
                                             FlipFailed(stranded), RebindTorn
                       no answer by the deadline, or the worker went ─► FlipFailed(stranded,
                       stranded_bytes = the arena bytes at stake), RebindTorn (every reader)

The worker names its arena's readers (the runner's parameter views, captured graphs, the serving
loop) only in its answer, so the rebind lists them as one reader, ``worker``: stamped when every
reader the answer names is at ``to_gen`` and none refused. ``router`` is the control's reader (it
routes requests by the resident model): at ``to_gen`` once the fold shows the new image.

An arena is *closed* to requests while a flip of it runs, while it sleeps, and while stranded
(``closed``); a complete flip or wake repairs a stranded one.
"""
from __future__ import annotations

import msgspec

from residency.events import catalog as ev
from residency.events.commands import WeightsSwapped
from residency.control.state import ArenaState, State

ARENA = "weights"
ROUTER = "router"
WORKER = "worker"
ACTIONS = ("flip", "sleep", "wake")


class InvalidFlip(ValueError):
    """A flip that names nothing flippable; nothing is recorded, the asker gets the reason."""


class UnknownModel(InvalidFlip):
    """A flip to a model no worker was started with (the message lists those it was)."""


class FlipPlan(msgspec.Struct, frozen=True, kw_only=True):
    worker: int
    action: str
    from_model: str
    to_model: str
    level: int
    bytes_out: int                    # device -> host (a level-2 sleep copies nothing out)
    bytes_in: int                     # host or file -> device


class FlipRefused(msgspec.Struct, frozen=True, kw_only=True):
    """A flip declined as asked; recorded as a ``MoveRefused`` and nothing else."""

    worker: int
    action: str
    code: str                         # flip_in_progress | already_asleep | not_asleep | asleep | already_resident
    reason: str
    asked_bytes: int

    def event(self, origin: str) -> ev.MoveRefused:
        return ev.MoveRefused(ask=origin, worker=self.worker, tier="device", asked_bytes=self.asked_bytes,
                              available_bytes=0, floor_bytes=0, reason=f"{self.code}: {self.reason}")


def flip_id(epoch: int, n: int) -> str:
    """Unique across restarts: the control epoch is part of it."""
    return f"fl-{epoch:x}-{n}"


def arena_of(state: State, worker: int) -> ArenaState | None:
    return state.arenas.get(f"{worker}:{ARENA}")


def describe(arena: ArenaState) -> str:
    if arena.asleep:
        return f"asleep (level {arena.sleep_level}, {arena.model!r} to wake)"
    return f"serving {arena.model!r}"


# ------------------------------------------------------------------ is the arena serving?
def closed(state: State, worker: int) -> tuple[str, str] | None:
    """(code, reason) when ``worker``'s arena takes no request now, else None."""
    arena = arena_of(state, worker)
    if arena is None:
        return None
    if arena.flip_in_flight:
        what = arena.action or "flip"
        to = f" to {arena.incoming_model!r}" if what == "flip" else ""
        return ("flip_in_progress", f"worker {worker} is running {what} {arena.flip_in_flight}{to}")
    if arena.stranded:
        return ("weights_stranded", f"the weights arena of worker {worker} is stranded by {arena.stranded} "
                                    f"({arena.stranded_bytes} bytes whose image is unknown); a complete flip or "
                                    f"wake repairs it (e.g. `residency ctl flip --to MODEL --worker {worker}`)")
    if arena.asleep:
        return ("asleep", f"worker {worker} is asleep (level {arena.sleep_level}); POST /wake_up wakes it")
    return None


def stranded_arenas(state: State) -> list[str]:
    """A line per stranded arena, for /health and status."""
    out = []
    for key in sorted(state.arenas):
        a = state.arenas[key]
        ws = state.workers.get(a.worker)
        if a.stranded and ws is not None and ws.alive:
            out.append(closed(state, a.worker)[1])
    return out


def resident(state: State, worker: int) -> str | None:
    """The model ``worker`` serves now: None while its arena is closed (or it has none)."""
    arena = arena_of(state, worker)
    if arena is None or closed(state, worker) is not None:
        return None
    return arena.model


# ------------------------------------------------------------------ the plan
def check(state: State, worker: int, action: str, to_model: str, level: int,
          models: dict[str, int]) -> FlipPlan | FlipRefused:
    """The plan of a flip, sleep or wake, or its refusal; InvalidFlip for one that names nothing.
    ``models``: the worker's models -> their image bytes (ServingReady.models)."""
    if action not in ACTIONS:
        raise InvalidFlip(f"action {action!r} is none of {list(ACTIONS)}")
    ws = state.workers.get(worker)
    if ws is None or not ws.alive:
        raise InvalidFlip(f"worker {worker} is not serving")
    arena = arena_of(state, worker)
    if arena is None:
        raise InvalidFlip(f"worker {worker} holds no weights arena (it serves no model)")
    if action == "flip" and to_model not in models:
        raise UnknownModel(f"model_not_found: worker {worker} was not started with {to_model!r}; it serves "
                           f"{', '.join(repr(m) for m in models) or 'nothing'}")
    if action == "sleep" and level not in (1, 2):
        raise InvalidFlip(f"sleep level {level} is neither 1 (weights to host) nor 2 (weights dropped)")
    bytes_in = models.get(to_model, arena.bytes) if action == "flip" else (arena.bytes if action == "wake" else 0)

    def refuse(code: str, reason: str) -> FlipRefused:
        return FlipRefused(worker=worker, action=action, code=code, reason=reason, asked_bytes=bytes_in)

    if arena.flip_in_flight:
        return refuse("flip_in_progress", f"{arena.action or 'flip'} {arena.flip_in_flight} is running on worker "
                                          f"{worker}; ask again once it has ended")
    if action == "sleep":
        if arena.asleep:
            return refuse("already_asleep", f"worker {worker} is already {describe(arena)}")
        if arena.stranded:
            return refuse("weights_stranded", closed(state, worker)[1])
        return FlipPlan(worker=worker, action=action, from_model=arena.model, to_model="", level=level,
                        bytes_out=arena.bytes if level == 1 else 0, bytes_in=0)
    if action == "wake":
        if not arena.asleep and not arena.stranded:
            return refuse("not_asleep", f"worker {worker} is awake, {describe(arena)}")
        return FlipPlan(worker=worker, action=action, from_model="", to_model=arena.model, level=arena.sleep_level,
                        bytes_out=0, bytes_in=arena.bytes)
    if arena.asleep:
        return refuse("asleep", f"worker {worker} is {describe(arena)}: wake it before flipping")
    if to_model == arena.model and not arena.stranded:
        return refuse("already_resident", f"worker {worker} already serves {to_model!r}")
    return FlipPlan(worker=worker, action=action, from_model=arena.model, to_model=to_model, level=0,
                    bytes_out=arena.bytes, bytes_in=bytes_in)


# ------------------------------------------------------------------ the rebind
def requested(state: State, plan: FlipPlan, fid: str, from_gen: int,
              deadline_ns: int, kv_pool_bytes: int | None = None) -> tuple[ev.FlipRequested, ev.RebindRequested]:
    """The write-ahead records of a flip: the flip and the rebind of the arena's readers. The next
    gen is above every gen this arena has had in the ledger (a flip that never answered may have
    moved it). ``kv_pool_bytes``: a sleep's KV pool size before it shrank (the wake's target)."""
    arena = arena_of(state, plan.worker)
    seen = [rb.to_gen for rb in state.rebinds.values()
            if rb.worker == plan.worker and rb.pool == ARENA and rb.status != "superseded"]
    to_gen = max([from_gen, arena.gen if arena else 0] + seen) + 1
    flip = ev.FlipRequested(flip_id=fid, worker=plan.worker, arena=ARENA, from_model=plan.from_model,
                            to_model=plan.to_model, bytes_out=plan.bytes_out, bytes_in=plan.bytes_in,
                            action=plan.action, level=plan.level, to_gen=to_gen, deadline_ns=deadline_ns,
                            kv_pool_bytes=kv_pool_bytes if plan.action == "sleep" else None)
    rebind = ev.RebindRequested(rebind_id=fid, worker=plan.worker, pool=ARENA, from_gen=from_gen, to_gen=to_gen,
                                readers=[ROUTER, WORKER])
    return flip, rebind


def worker_answer(req: ev.FlipRequested, ans: WeightsSwapped, at_stake: int) -> list[ev.Event]:
    """What a worker's ``WeightsSwapped`` records before the router stamps (``verdict`` after)."""
    if ans.error:                     # nothing changed: the arena and its readers stay at from_gen
        return [ev.FlipFailed(flip_id=req.flip_id, error=ans.error),
                ev.RebindRefused(rebind_id=req.flip_id, worker=req.worker, error=ans.error)]
    behind = sorted(r for r, g in ans.stamps.items() if g != req.to_gen)
    refused = sorted(ans.refused)
    if not ans.checksum_ok or behind or refused:
        why = "; ".join(x for x in (
            "" if ans.checksum_ok else "the images' checksums did not verify after the swap",
            f"readers behind gen {req.to_gen}: {behind}" if behind else "",
            f"readers refused: {', '.join(f'{r} ({ans.refused[r]})' for r in refused)}" if refused else "") if x)
        return [ev.FlipFailed(flip_id=req.flip_id, error=why, stranded=True, stranded_bytes=at_stake),
                ev.RebindTorn(rebind_id=req.flip_id, readers_behind=[ROUTER, WORKER])]
    return [ev.ReaderStamped(rebind_id=req.flip_id, reader=WORKER, gen=req.to_gen),
            ev.FlipCompleted(flip_id=req.flip_id, bytes_out=ans.bytes_out, bytes_in=ans.bytes_in,
                             started_ns=ans.started_ns, finished_ns=ans.finished_ns,
                             overlapped_steps=ans.overlapped_steps, checksum_ok=ans.checksum_ok, worker=req.worker,
                             to_gen=req.to_gen, dropped_bytes=ans.dropped_bytes, steps=ans.steps, out_ns=ans.out_ns,
                             in_ns=ans.in_ns, measured_freed_bytes=ans.measured_freed_bytes)]


def router_at(state: State, req: ev.FlipRequested) -> bool:
    """The router reads the arena from the folded state: at ``to_gen`` once it shows the flip done."""
    arena = arena_of(state, req.worker)
    return arena is not None and arena.flip_in_flight is None and arena.gen == req.to_gen


def verdict(req: ev.FlipRequested, stamped: set[str]) -> ev.RebindCommitted | ev.RebindTorn:
    late = [r for r in (ROUTER, WORKER) if r not in stamped]
    if late:
        return ev.RebindTorn(rebind_id=req.flip_id, readers_behind=late)
    return ev.RebindCommitted(rebind_id=req.flip_id)


def stranded(req: ev.FlipRequested, at_stake: int, why: str) -> list[ev.Event]:
    """No answer by the deadline, or the worker went: the arena's image is unknown."""
    return [ev.FlipFailed(flip_id=req.flip_id, error=why, stranded=True, stranded_bytes=at_stake),
            ev.RebindTorn(rebind_id=req.flip_id, readers_behind=[ROUTER, WORKER])]


def stranded_at_recovery(state: State) -> list[ev.FlipFailed]:
    """After a control restart: a flip requested and never answered strands its arena (its
    rebind is torn by ``dial.torn_at_recovery``), so a crashed control never trusts an image
    nobody verified."""
    out = []
    for fid, key in state.flips.items():
        arena = state.arenas.get(key)
        out.append(ev.FlipFailed(flip_id=fid, error="the control process restarted while the flip was in flight",
                                 stranded=True, stranded_bytes=arena.inflight_bytes if arena else None))
    return out


# ------------------------------------------------------------------ the KV pool a sleep gives back
# A sleep also shrinks the worker's device KV pool through the dial (control/dialing.py), and the
# wake grows it back; the dial's asks carry this suffix in their origin so that the dial's own
# refusal (a floor, a resize already running) is told apart from the sleep's: the sleep completes
# all the same, and its answer says the pool stayed as it was and why.
KV_POOL = "kv-pool"


def kv_pool_origin(origin: str) -> str:
    return f"{origin}:{KV_POOL}"


def is_pool_refusal(e: ev.Event) -> bool:
    """A refusal of the pool resize a sleep or wake asked for: not the sleep's own refusal."""
    return type(e) is ev.MoveRefused and e.ask.endswith(f":{KV_POOL}")


def kv_pool_outcome(events: list[ev.Event]) -> list[dict]:
    """Per resize of a device KV pool among ``events`` (a sleep's or wake's answer): resized with
    its bytes and what the driver measured freed, or not, with the refusal's words and arithmetic."""
    pools = {e.rebind_id: e.worker for e in events if type(e) is ev.RebindRequested and e.pool != ARENA}
    out: list[dict] = []
    for e in events:
        t = type(e)
        if t is ev.PoolResized and e.pool != ARENA:
            out.append({"worker": e.worker, "resized": True, "from_bytes": e.from_bytes, "to_bytes": e.to_bytes,
                        "measured_freed_bytes": e.measured_freed_bytes})
        elif is_pool_refusal(e):
            out.append({"worker": e.worker, "resized": False, "asked_bytes": e.asked_bytes,
                        "floor_bytes": e.floor_bytes, "reason": e.reason})
        elif t is ev.RebindRefused and e.rebind_id in pools:
            out.append({"worker": e.worker, "resized": False, "reason": f"the worker refused: {e.error}"})
        elif t is ev.RebindTorn and e.rebind_id in pools:
            out.append({"worker": pools[e.rebind_id], "resized": False,
                        "reason": f"rebind {e.rebind_id} torn, readers behind: {e.readers_behind}"})
    return out


def freed_bytes(events: list[ev.Event]) -> int | None:
    """Device bytes the driver saw freed by a sleep, weights and KV pool together (a wake: negative);
    None when nothing was measured (a CPU host)."""
    got = [e.measured_freed_bytes for e in events
           if (type(e) is ev.FlipCompleted or (type(e) is ev.PoolResized and e.pool != ARENA))
           and e.measured_freed_bytes is not None]
    return sum(got) if got else None
