"""The life of a move, as the control process lives it (docs/architecture.md, "The life of a move"). Pure.

    proposal (an ask resolved, or a policy's)
        ──validate──► invalid: answered with a named error, nothing recorded
        ──fund──────► MoveRefused{asked, available, floor}; nothing else happens
        ──request───► MoveRequested{move_id, ..., deadline}   committed BEFORE the command is sent
                      ExecuteMove (or ReleaseBlocks)  ──►  worker
        ◄──────────── MoveAcked | MoveFailed | MoveRejected   (idempotent by move_id)
        ──classify──► the terminal event, once; a duplicate is ignored; an ack for a stranded
                      move becomes MoveLateAcked, its rejection or failure MoveLateFailed;
                      park/restore acks are followed by SessionParked / SessionRestored;
                      a release's ack is CopiesReleased

``MoveBook`` holds what the control process knows about moves that the ledger does not: which
requests are still waiting for their commit (not sent yet), which were sent, and who is waiting
for an outcome. It is rebuilt empty on restart; recovery queries the workers instead.
"""
from __future__ import annotations

import collections
import operator
from collections.abc import Callable

import msgspec

from residency.events import catalog as ev
from residency.events.commands import BlocksReleased, ExecuteMove, ReleaseBlocks
from residency.events.asks import AskMove
from residency.control.budget import Refusal, can_fund
from residency.control.policy.proposals import KIND_DEFAULTS, Proposal, busy_blocks, release
from residency.control.policy.restore import plan_restore
from residency.control.state import MoveState, State, copies_on

S = 1_000_000_000
_TIERS = operator.attrgetter("tiers")


class MoveConfig(msgspec.Struct, kw_only=True):
    deadline_base_s: float = 5.0               # every move gets this much ...
    deadline_bytes_per_s: float = 1.0e9        # ... plus its bytes at this (pessimistic) rate
    page_tokens: int = 16                      # tokens per block, for SessionRestored.restored_tokens


class InvalidAsk(Exception):
    """An ask or proposal that names something the state does not have (unknown worker, block, tier, or a
    block already busy in another move). Nothing is recorded; the asker gets the reason."""


class NothingToMove(InvalidAsk):
    """An ask for every block of a session on a tier where the session has none: the session is
    already where the verb would put it (a park of a parked session). Nothing is recorded, and
    that is the answer, not an error; the message says where the session's blocks are."""


def move_id(epoch: int, n: int) -> str:
    """Unique across restarts: the control epoch is part of it."""
    return f"m-{epoch:x}-{n}"


# ------------------------------------------------------------------ an AskMove -> its proposals
# NOTE: a big move names thousands of blocks (a 2 GiB spill of 2 MiB pages: 1024), and every check
# below runs on the control loop between the ask and the command: one pass per block, set algebra
# (in C) where a check is a membership test, and each fact is checked once.
def resolve(state: State, msg: AskMove, origin: str, busy: dict[int, set[int]] | None = None) -> list[Proposal]:
    """The proposals an ``AskMove`` means, against the current state; raises InvalidAsk."""
    if msg.kind not in KIND_DEFAULTS:
        raise InvalidAsk(f"unknown move kind {msg.kind!r}")
    ws = state.workers.get(msg.worker)
    if ws is None or not ws.alive:
        raise InvalidAsk(f"worker {msg.worker} is not serving (known: {sorted(state.workers)})")
    src0, dst0, keep0 = KIND_DEFAULTS[msg.kind]
    src = msg.src or src0
    dst = msg.dst or dst0
    keep = keep0 if msg.keep_source is None else msg.keep_source
    wb = state.blocks.get(msg.worker, {})
    if msg.blocks:
        blocks = msg.blocks
        block_set = set(blocks)
        if len(block_set) != len(blocks):
            blocks = list(dict.fromkeys(blocks))
        # every block is looked up once below, by the pass that plans it: a KeyError there means
        # an unknown block (``_raise_unknown`` names them), so no separate pass checks that they exist
    elif msg.session is not None:
        session = msg.session
        blocks = [b for b, st in wb.items() if st.session == session]
        if not blocks:
            raise InvalidAsk(f"session {msg.session!r} has no blocks on worker {msg.worker}")
        block_set = set(blocks)
    else:
        raise InvalidAsk("name the blocks or the session to move")
    if msg.kind == "restore":
        # plan_restore keeps only blocks with a copy on their source and none on the device
        try:
            proposals = plan_restore(state, origin, msg.worker, blocks, msg.session, keep, msg.src, block_set)
        except KeyError:
            _raise_unknown(msg.worker, wb, blocks)
            raise
        if not proposals:
            if not msg.blocks and all("device" in wb[b].tiers for b in blocks):
                raise NothingToMove(f"session {msg.session!r} is already on the device "
                                    f"({_where(wb, blocks)}); nothing moved")
            raise InvalidAsk(f"nothing to restore: blocks {blocks[:16]} are on the device or have no copy"
                             f"{' on ' + msg.src if msg.src else ''}")
    else:
        if src == dst:
            _raise_unknown(msg.worker, wb, blocks)      # unknown blocks are named first, as for any kind
            raise InvalidAsk(f"{msg.kind} needs two different tiers, got {src} -> {dst}")
        try:
            proposals = _split(msg, origin, wb, copies_on(state, msg.worker, src), copies_on(state, msg.worker, dst),
                          blocks, block_set, src, dst, keep)
        except KeyError:
            _raise_unknown(msg.worker, wb, blocks)
            raise           # no named block is unknown: a bug, raised as it is
    busy = busy if busy is not None else busy_blocks(state)
    for a in proposals:      # the blocks' copies were checked above, against this same state
        _check_route(state, a)
        # one proposal of every block (the usual case): the set made above is its blocks, and set-to-set
        # algebra walks the smaller side (a few busy blocks, not the 1024 asked)
        _check_not_busy(state, a, busy, block_set if len(proposals) == 1 and len(a.blocks) == len(block_set) else None)
    return proposals


def _where(wb: dict, blocks: list[int]) -> str:
    """'3 blocks on host, 1 on disk': how many of ``blocks`` have a copy on each tier."""
    counts = {t: sum(1 for b in blocks if t in wb[b].tiers) for t in ev.TIERS}
    parts = [f"{n} on {t}" for t, n in counts.items() if n]
    return f"{len(blocks)} blocks: " + ", ".join(parts) if parts else f"{len(blocks)} blocks, no copy"


def _raise_unknown(worker: int, wb: dict, blocks: list[int]) -> None:
    """InvalidAsk naming the blocks ``worker`` does not have, if any."""
    if not wb.keys() >= set(blocks):
        raise InvalidAsk(f"worker {worker} has no blocks {[b for b in blocks if b not in wb][:16]}") from None


def _split(msg: AskMove, origin: str, wb: dict, on_src, on_dst, blocks: list[int], block_set: set[int],
           src: str, dst: str, keep: bool) -> list[Proposal]:
    """``split_for_destination`` of the blocks with a copy on ``src``, in the same single pass
    that finds them: blocks with a copy on ``dst`` already need no copy (only a release of the
    source, when the source is to be freed)."""
    to_copy: list[int] = []
    already: list[int] = []
    no_src: list[int] = []
    # The usual big move: every block on the source, none on the destination. The state's copy
    # index says so by set algebra (hash probes into two compact tables, not a lookup of each
    # block's record: after an idle wait those records are cache misses, ~0.1 ms per 1024), and
    # between sets (``block_set`` is ``blocks``): a subset test by sizes first, a disjointness
    # test over the smaller side (the destination's index is often empty).
    if on_src >= block_set and on_dst.isdisjoint(block_set):
        return [Proposal(origin=origin, kind=msg.kind, worker=msg.worker, src=src, dst=dst, blocks=tuple(blocks),
                         keep_source=keep, session=msg.session, reason=origin)]
    # Otherwise every block's copies, looked up in C (a KeyError names an unknown block, as
    # below); blocks that all have the same copies are planned together, one check for all.
    tiers_of = list(map(_TIERS, operator.itemgetter(*blocks)(wb))) if len(blocks) > 1 else [wb[blocks[0]].tiers]
    first = tiers_of[0]
    if tiers_of.count(first) == len(tiers_of):
        (no_src if src not in first else already if dst in first else to_copy).extend(blocks)
    else:
        for b, tiers in zip(blocks, tiers_of):
            if src not in tiers:
                no_src.append(b)
            elif dst in tiers:
                already.append(b)
            else:
                to_copy.append(b)
    if msg.blocks and no_src:
        raise InvalidAsk(f"blocks {no_src[:16]} have no copy on {src}")
    if not to_copy and not already:
        if not msg.blocks:      # every block of the session on src: there are none, so none to move
            raise NothingToMove(f"session {msg.session!r} has no blocks on {src} ({_where(wb, blocks)}); "
                                f"nothing moved")
        raise InvalidAsk(f"session {msg.session!r} has no blocks on {src}")
    proposals = []
    if to_copy:
        proposals.append(Proposal(origin=origin, kind=msg.kind, worker=msg.worker, src=src, dst=dst,
                                  blocks=tuple(to_copy), keep_source=keep, session=msg.session, reason=origin))
    if already and not keep:
        proposals.append(release(origin, msg.worker, src, already, f"{msg.kind} (copy already on {dst})", msg.session))
    if not proposals:
        raise InvalidAsk(f"blocks {already[:16]} already have a copy on {dst}")
    return proposals


def validate(state: State, proposal: Proposal, busy: dict[int, set[int]] | None = None) -> None:
    """Raise InvalidAsk unless every block has a copy on src (and none on dst, for a copy) and no
    other unresolved move names it."""
    _check_route(state, proposal)
    wb = state.blocks.get(proposal.worker, {})
    src, dst, copy = proposal.src, proposal.dst, not proposal.is_release
    bad: list[int] = []
    there: list[int] = []
    for b in proposal.blocks:
        st = wb.get(b)
        if st is None or src not in st.tiers:
            bad.append(b)
        elif copy and dst in st.tiers:
            there.append(b)
    if bad:
        raise InvalidAsk(f"blocks {bad[:16]} have no copy on {src} of worker {proposal.worker}")
    if there:
        raise InvalidAsk(f"blocks {there[:16]} already have a copy on {dst}")
    _check_not_busy(state, proposal, busy if busy is not None else busy_blocks(state))


def _check_route(state: State, proposal: Proposal) -> None:
    ws = state.workers.get(proposal.worker)
    if ws is None or not ws.alive:
        raise InvalidAsk(f"worker {proposal.worker} is not serving")
    for t in (proposal.src, proposal.dst):
        if t not in ws.tiers:
            raise InvalidAsk(f"no tier {t!r}")
    if ws.tiers[proposal.dst].capacity_bytes == 0:
        raise InvalidAsk(f"worker {proposal.worker} has no {proposal.dst} tier")
    if not proposal.blocks:
        raise InvalidAsk("no blocks")


def _check_not_busy(state: State, proposal: Proposal, busy: dict[int, set[int]],
                    block_set: set[int] | None = None) -> None:
    """``block_set``: the proposal's blocks as a set, when the caller has it."""
    taken = busy.get(proposal.worker)
    if taken and not taken.isdisjoint(proposal.blocks if block_set is None else block_set):
        clash = [b for b in proposal.blocks if b in taken]
        raise InvalidAsk(f"blocks {clash[:16]} are busy: {_holders(state, proposal.worker, clash)}")


def _holders(state: State, worker: int, clash: list[int]) -> str:
    """The moves that hold ``clash`` in words; a stranded one says why it still holds them (the
    asker can do nothing until its worker answers, so telling it to retry later is not enough)."""
    wanted = set(clash)
    named: list[str] = []
    for mv in (*state.inflight.values(), *state.stranded.values()):
        if mv.worker != worker or wanted.isdisjoint(mv.blocks):
            continue
        what = f"move {mv.move_id} ({mv.kind} {mv.src} -> {mv.dst}, requested at seq {mv.requested_seq})"
        if mv.move_id in state.stranded:
            what += (f" is stranded: worker {worker} never answered it by its deadline; its blocks stay held"
                     f" until the worker acks or rejects it")
        else:
            what += " has no outcome yet"
        named.append(what)
        if len(named) == 3:
            break
    return "; ".join(named) or "in use by a running request or a move that has no outcome yet"


def fund(state: State, proposals: list[Proposal], reserved: dict[tuple[int, str], int] | None = None) -> Refusal | None:
    """All or nothing: the proposals' total per destination must fit, or the whole proposal is refused
    with the total's arithmetic (never a smaller part of it). Releases need no funding.
    ``reserved``: per (worker, tier), room held for stranded moves (``budget.stranded_toward``)."""
    totals: dict[tuple[int, str], int] = {}
    for a in proposals:
        if not a.is_release:
            key = (a.worker, a.dst)
            totals[key] = totals.get(key, 0) + len(a.blocks) * state.workers[a.worker].block_bytes
    for (w, tier), asked in totals.items():
        refusal = can_fund(state, w, tier, asked, (reserved or {}).get((w, tier), 0))
        if refusal is not None:
            return refusal
    return None


# ------------------------------------------------------------------ requested -> command
def requested(state: State, proposal: Proposal, mid: str, now_ns: int, cfg: MoveConfig) -> ev.MoveRequested:
    nbytes = len(proposal.blocks) * state.workers[proposal.worker].block_bytes
    deadline = now_ns + int(cfg.deadline_base_s * S) + int(nbytes / cfg.deadline_bytes_per_s * S)
    return ev.MoveRequested(move_id=mid, kind=proposal.kind, worker=proposal.worker, src=proposal.src, dst=proposal.dst,
                            blocks=list(proposal.blocks), bytes_planned=nbytes, keep_source=proposal.keep_source,
                            deadline_ns=deadline, reason=proposal.reason or proposal.origin, session=proposal.session)


def command_for(req: ev.MoveRequested) -> ExecuteMove | ReleaseBlocks:
    if req.src == req.dst:
        return ReleaseBlocks(release_id=req.move_id, tier=req.src, blocks=req.blocks)
    return ExecuteMove(move_id=req.move_id, kind=req.kind, src=req.src, dst=req.dst, blocks=req.blocks,
                       keep_source=req.keep_source, deadline_ns=req.deadline_ns, session=req.session)


def release_outcome(msg: BlocksReleased, now_ns: int) -> ev.MoveAcked:
    """A release's answer as the move outcome it settles, carrying the freed bytes the worker
    measured (``settle_events`` records it as CopiesReleased)."""
    return ev.MoveAcked(move_id=msg.release_id, worker=msg.worker, bytes_moved=0,
                        bytes_freed_src=msg.bytes_freed, checksum_ok=True, started_ns=now_ns, finished_ns=now_ns)


# ------------------------------------------------------------------ outcome -> event
Outcome = ev.MoveAcked | ev.MoveFailed | ev.MoveRejected

TERMINAL = "terminal"           # the move was in flight: record the outcome as it came
LATE = "late"                   # the move was stranded and this is its ack: record MoveLateAcked
LATE_FAILURE = "late_failure"   # stranded, then rejected or failed: record MoveLateFailed
DUPLICATE = "duplicate"         # the move already has its outcome: nothing to record
UNKNOWN = "unknown_move"        # never requested in this ledger
WRONG_WORKER = "wrong_worker"   # requested of another worker


def classify(state: State, worker: int, outcome: Outcome) -> tuple[str, ev.Event | None]:
    mid = outcome.move_id
    mv = state.inflight.get(mid)
    if mv is not None:
        if mv.worker != worker:
            return WRONG_WORKER, None
        return TERMINAL, outcome
    mv = state.stranded.get(mid)
    if mv is not None:
        if mv.worker != worker:
            return WRONG_WORKER, None
        if type(outcome) is ev.MoveAcked:
            return LATE, ev.MoveLateAcked(
                move_id=mid, worker=worker, bytes_moved=outcome.bytes_moved, bytes_freed_src=outcome.bytes_freed_src,
                checksum_ok=outcome.checksum_ok, started_ns=outcome.started_ns, finished_ns=outcome.finished_ns)
        return LATE_FAILURE, late_failure(mid, worker, type(outcome).__name__,
                                          getattr(outcome, "reason", None) or getattr(outcome, "error", ""))
    if mid in state.outcomes:
        return DUPLICATE, None
    return UNKNOWN, None


def late_failure(mid: str, worker: int, answer: str, reason: str) -> ev.MoveLateFailed:
    """The event that closes a stranding the worker says never landed."""
    return ev.MoveLateFailed(move_id=mid, worker=worker, answer=answer, reason=reason)


def settle_events(mv: MoveState, event: ev.Event, cfg: MoveConfig, state: State | None = None) -> list[ev.Event]:
    """What to record for a move's outcome: the outcome itself, then the facts it implies.

    A release's ack, on time or late, becomes ``CopiesReleased(bytes=measured)``: 0 measured is
    recorded as 0 (an accounting); silence never gets here (the watchdog strands it).
    """
    if mv.src == mv.dst and type(event) in (ev.MoveAcked, ev.MoveLateAcked):
        return [ev.CopiesReleased(move_id=mv.move_id, worker=mv.worker, tier=mv.src, blocks=list(mv.blocks),
                                  bytes=event.bytes_freed_src, session=mv.session)]      # the why is on the MoveRequested (causation)
    return [event, *followups(mv, event, cfg, state)]


def followups(mv: MoveState, event: ev.Event, cfg: MoveConfig, state: State | None = None) -> list[ev.Event]:
    """Session facts an acked park or restore implies (recorded right after the ack)."""
    if mv.session is None or type(event) not in (ev.MoveAcked, ev.MoveLateAcked):
        return []
    if mv.kind == "park":
        return [ev.SessionParked(session=mv.session, worker=mv.worker, tier=mv.dst, bytes=event.bytes_moved,
                                 move_id=mv.move_id)]
    if mv.kind == "restore" and mv.dst == "device" and event.checksum_ok:
        return [ev.SessionRestored(session=mv.session, worker=mv.worker,
                                   restored_tokens=restored_tokens(mv, cfg.page_tokens, state), computed_tokens=0,
                                   move_id=mv.move_id)]
    return []


def restored_tokens(mv: MoveState, page_tokens: int, state: State | None) -> int:
    """Positions a restore of a session's pages brought back: a full page holds ``page_tokens``;
    the session's partial last page (the one page with no content key) holds what the session's
    last commit said it holds beyond its full pages. Unknown (no state, blocks without keys, a
    session that never said): every page counts whole."""
    whole = len(mv.blocks) * page_tokens
    sess = state.sessions.get(mv.session) if state is not None else None
    if sess is None or sess.num_tokens is None:
        return whole
    wb = state.blocks.get(mv.worker, {})
    partial = [b for b in mv.blocks if (st := wb.get(b)) is not None and not st.key]
    if len(partial) != 1:
        return whole
    in_tail = sess.num_tokens % page_tokens
    return whole - (page_tokens - in_tail if in_tail else 0)


# ------------------------------------------------------------------ control-side bookkeeping
class AskWaiter:
    """Someone waiting for an proposal's outcome: answered once every move it started has its terminal
    event (or at once with the refusal), after those events are committed."""

    __slots__ = ("ask_id", "answer", "wait", "move_ids", "open", "events", "refs", "off_loop")

    def __init__(self, ask_id: str, answer: Callable, wait: bool = True):
        self.ask_id = ask_id
        self.answer = answer            # called with (events [(seq, event)], move_ids, error, detail)
        self.wait = wait
        self.move_ids: list[str] = []
        self.open: set[str] = set()     # move ids (or command refs) still without an outcome
        self.events: list[tuple[int, ev.Event]] = []
        self.refs: set[str] = set()
        self.off_loop = ""              # "thread" / "socket": asked from off the loop's thread, may hear
                                        # before the ack's fold; "": the loop thread, hears after it

    @property
    def done(self) -> bool:
        return not self.open


class BusyIndex:
    """Blocks named by a move without a settled outcome, per worker, kept as moves come and go
    (``policy.proposals.busy_blocks`` recomputes the same from the state, for the pure callers).

    A stranded move keeps its blocks busy until its worker has answered for it (a late ack, or a
    report saying it failed or never arrived: the worker then never runs it), because until then
    the copy might still be happening.
    """

    def __init__(self, state: State):
        self.by_worker: dict[int, set[int]] = busy_blocks(state)

    def add(self, worker: int, blocks) -> None:
        self.by_worker.setdefault(worker, set()).update(blocks)

    def remove(self, worker: int, blocks) -> None:
        self.by_worker.get(worker, set()).difference_update(blocks)

    def drop_worker(self, worker: int) -> None:
        self.by_worker.pop(worker, None)


class MoveBook:
    def __init__(self) -> None:
        self.awaiting_commit: collections.deque[tuple[int, ev.MoveRequested]] = collections.deque()
        self.undispatched: set[str] = set()              # requested, command not sent yet
        self.dispatched: dict[str, int] = {}             # move_id -> sent at (monotonic ns)
        self.waiters: dict[str, AskWaiter] = {}          # move_id or command ref -> its origin

    def requested(self, seq: int, req: ev.MoveRequested, waiter: AskWaiter | None) -> None:
        self.awaiting_commit.append((seq, req))
        self.undispatched.add(req.move_id)
        if waiter is not None:
            waiter.move_ids.append(req.move_id)
            waiter.open.add(req.move_id)
            self.waiters[req.move_id] = waiter

    def committed(self, through_seq: int) -> list[ev.MoveRequested]:
        """Requests whose MoveRequested is now committed: their commands may be sent."""
        out = []
        q = self.awaiting_commit
        while q and q[0][0] <= through_seq:
            out.append(q.popleft()[1])
        return out

    def sent(self, mid: str, at_ns: int) -> None:
        self.undispatched.discard(mid)
        self.dispatched[mid] = at_ns

    def settled(self, mid: str) -> AskWaiter | None:
        """The move has its terminal outcome: forget it; return its waiter (if any)."""
        self.undispatched.discard(mid)
        self.dispatched.pop(mid, None)
        return self.waiters.pop(mid, None)

    def ours(self, mid: str) -> bool:
        """Requested by this incarnation of the control process."""
        return mid in self.undispatched or mid in self.dispatched
