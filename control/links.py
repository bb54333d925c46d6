"""The worker registry: the control process's side of its workers -- links, Hello and adoption,
heartbeats, loss, and every message on the worker socket.

    Hello (new incarnation)  ─► WorkerJoined, then QueryMoves for what it may have done for us
    Hello (same incarnation) ─► adopted after a control restart (no event), queried again
    silence > heartbeat_missed_s ─► WorkerHeartbeatMissed;  > worker_lost_s ─► WorkerLost
    its process exits            ─► WorkerLost, but (keep_disk) one that held disk copies waits up to
                   replace_wait_s for its next incarnation's Hello, whose verified files the loss keeps
    a message from a sender that never said Hello ─► ErrorReply(unknown_worker): it says Hello again
    Hello.lane (the worker's device-thread socket) ─► device-thread commands wait for its LaneHello,
                   then go to the lane; Ping, QueryMoves, Shutdown and Tokenize (the worker tokenizes
                   on its side threads) always go to the Hello socket;
                   no LaneHello within lane_wait_s ─► the lane is given up: held and later commands
                   go to the Hello socket (the worker's I/O thread hands them to its device thread in order)

A worker's other messages go to the handler registered for their type (``handlers``: the move
dispatcher's outcomes, the ask handler's commits, the serving path's tokens). A lost worker's
moves are settled by the move dispatcher (``settle``); a joined one gets the commands that
waited for it (``on_joined``). Loop thread only.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Collection

import structlog
import zmq

from residency.events import catalog as ev
from residency.events.commands import (
    ClaimDisk, DiskClaimed, ErrorReply, Hello, LaneHello, PinnedChanged, Ping, Pong, PoolSizing, QueryMemory, QueryMoves,
    Shutdown,
    Tokenize,
)
from residency.ledger.errors import LedgerError
from residency.control import recovery, watchdog
from residency.control.config import ControlConfig
from residency.control.errors import ControlError, LedgerDiverged
from residency.control.moves import BusyIndex, MoveBook
from residency.control.recorder import Recorder
from residency.control.state import State
from residency.control.transport import (
    UNKNOWN_WORKER, WORKER_LOST, WORKER_MISMATCH, TransportError, WorkerRouter, WorkerUnreachable,
    parse_worker_identity, worker_identity,
)

log = structlog.get_logger("control.links")


def describe_sizing(s: PoolSizing | None) -> str | None:
    """The pool's sizing in one line (the worker's arithmetic, repeated in the control's log)."""
    if s is None:
        return None
    if s.how == "explicit":
        return f"{s.num_blocks} blocks (--device-blocks)"
    return (f"{s.num_blocks} blocks = {s.fraction} x {s.total_bytes} total - {s.in_use_bytes} in use - "
            f"{s.reserve_bytes} reserve, in blocks of {s.block_bytes}")
S = 1_000_000_000
# what a worker's I/O thread answers or hands to its side threads (dataplane/side.py): never sent
# to its lane
TO_IO_THREAD = (Ping, QueryMoves, Shutdown, ErrorReply, Tokenize, QueryMemory)


class WorkerLink:
    """One joined worker incarnation as the loop knows it: its socket identity, when it was last
    heard, and the move ids it has been queried about (QueryMoves) and not yet answered for."""

    __slots__ = ("worker", "identity", "epoch", "last_heard_ns", "missed", "queried", "last_query_ns", "device",
                 "lane", "lane_up", "held", "lane_by_ns", "pool_gen", "readers")

    def __init__(self, worker: int, identity: bytes, epoch: int, device: str, now_ns: int, lane: bytes | None = None):
        self.worker, self.identity, self.epoch, self.device = worker, identity, epoch, device
        self.last_heard_ns = now_ns
        self.missed = False
        self.queried: set[str] = set()
        self.last_query_ns = 0
        self.lane = lane              # the lane's identity, or None (everything to ``identity``)
        self.lane_up = False          # its LaneHello came: commands may go there
        self.held: list = []          # device-thread commands waiting for the lane to come up
        self.lane_by_ns = 0           # when the lane must be up (monotonic), or it is given up
        self.pool_gen = 0             # the generation its device pool carries (Hello, then each rebind)
        self.readers: list[str] = []  # its readers of that pool (Hello, ServingReady): each stamps a rebind


class WorkerRegistry:
    """The joined workers, by socket identity and by worker number (loop thread only)."""

    def __init__(self, cfg: ControlConfig, state: State, roster: dict[int, int], router: WorkerRouter,
                 recorder: Recorder, book: MoveBook, busy: BusyIndex, metrics: collections.Counter,
                 handlers: dict[type, Callable], crashed: bool, settle: Callable[[str, ev.Event], None],
                 on_joined: Callable[[int], None], on_gone: Callable[[int], None] = lambda w: None):
        self.cfg = cfg
        self.state = state
        self.roster = roster                   # worker -> epoch of its last WorkerJoined
        self.router = router
        self.recorder = recorder
        self.book = book
        self.busy = busy
        self.metrics = metrics
        self.handlers = handlers
        self.settle = settle
        self.on_joined = on_joined
        self.on_gone = on_gone                 # a worker's process is gone before its loss is recorded
        self.by_worker: dict[int, WorkerLink] = {}
        self.last_recv_ns = 0                  # wall clock of the last read off the socket (traces)
        self._links: dict[bytes, WorkerLink] = {}
        self._lanes: dict[bytes, WorkerLink] = {}        # lane identity -> its worker's link
        self._early_lanes: dict[bytes, int] = {}         # LaneHellos ahead of their Hello: identity -> epoch
        self._unhandled_logged: set[type] = set()
        self._stopped_cleanly = not crashed    # the last incarnation recorded ServerStopped
        now = time.monotonic_ns()
        # Workers the ledger says are serving: after a crash they get a grace to come back.
        alive = [w for w, ws in state.workers.items() if ws.alive]
        self._adopting: dict[int, int] = {w: now + int(cfg.adopt_grace_s * S) for w in alive} if crashed else {}
        # worker -> (until when its disk copies wait for the next incarnation, why the last one went)
        self._replacing: dict[int, tuple[int, str]] = {}
        self.sizing: dict[int, PoolSizing | None] = {}   # how each incarnation sized its pool (its Hello)
        # a Hello's group fields against serve's plan (control/groups.py): None, or why they disagree
        self.check_group: Callable[[int, str, int, int], str | None] = lambda w, g, rank, ranks: None

    @property
    def adopting(self) -> Collection[int]:
        """Workers the ledger says were serving before a crash, still within their grace."""
        return self._adopting.keys()

    @property
    def num_links(self) -> int:
        return len(self._links)

    def missing_workers(self) -> list[int]:
        """Expected workers with no live link and no grace pending: the supervisor starts these."""
        expected = self.cfg.expected_workers or []
        return [w for w in expected if w not in self.by_worker and w not in self._adopting]

    # ------------------------------------------------------------------ sending
    def send(self, link: WorkerLink, msg) -> bool:
        identity = link.identity
        if link.lane is not None and type(msg) not in TO_IO_THREAD:
            if not link.lane_up:      # in order, once its LaneHello proves the lane connected
                link.held.append(msg)
                return True
            identity = link.lane
        try:
            self.router.send(identity, msg)
            return True
        except WorkerUnreachable as e:
            self.metrics["send_unreachable"] += 1
            log.warning("worker_unreachable", worker=link.worker, error=e.detail)
            return False

    def send_to_worker(self, worker: int, msg) -> bool:
        """Send any command to a joined worker."""
        link = self.by_worker.get(worker)
        return link is not None and self.send(link, msg)

    def shutdown_all(self, reason: str) -> None:
        for link in list(self._links.values()):
            self.send(link, Shutdown(reason=reason))

    def query(self, link: WorkerLink, move_ids: list[str]) -> None:
        if move_ids:
            link.queried.update(move_ids)
            link.last_query_ns = time.monotonic_ns()
            self.send(link, QueryMoves(move_ids=move_ids))

    def _reply_error(self, identity: bytes, err: ErrorReply) -> None:
        try:
            self.router.send(identity, err)
        except WorkerUnreachable:
            pass

    # ------------------------------------------------------------------ receiving
    def recv(self) -> bool:
        """Read and handle one message; False when none is waiting."""
        self.last_recv_ns = time.time_ns()
        try:
            identity, msg = self.router.recv()
        except zmq.Again:
            return False
        except TransportError as e:
            self.metrics[f"bad_message_{e.name}"] += 1
            log.warning("bad_worker_message", error=e.name, detail=e.detail, identity=repr(e.identity[:32]))
            self._reply_error(e.identity, e.reply())
            return True
        link = self._links.get(identity) or self._lanes.get(identity)
        if type(msg) is LaneHello:
            self._on_lane_hello(link, identity, msg)
            return True
        if link is None:
            if type(msg) is Hello:
                self._on_hello_new(identity, msg)
            elif type(msg) is not ErrorReply:      # never answer an error with an error
                self.metrics["unknown_worker_messages"] += 1
                log.warning("unknown_worker_message", identity=repr(identity[:32]), type=type(msg).__name__)
                self._reply_error(identity, ErrorReply(error=UNKNOWN_WORKER,
                                                       detail=f"{identity[:32]!r} has not said Hello"))
            return True
        link.last_heard_ns = time.monotonic_ns()
        if link.missed:
            link.missed = False
        claimed = getattr(msg, "worker", link.worker)
        if claimed != link.worker:
            log.warning("worker_mismatch", worker=link.worker, claimed=claimed, type=type(msg).__name__)
            self._reply_error(identity, ErrorReply(error=WORKER_MISMATCH,
                                                   detail=f"message names worker {claimed}, sender is {link.worker}"))
            return True
        handler = self.handlers.get(type(msg))
        if handler is None:
            if type(msg) not in self._unhandled_logged:
                self._unhandled_logged.add(type(msg))
                log.warning("unhandled_worker_message", type=type(msg).__name__, worker=link.worker)
            return True
        try:
            handler(link, msg)
        except (ControlError, LedgerDiverged, LedgerError):
            raise       # the ledger failing (an ack commits inside its handler) ends the loop
        except Exception:  # noqa: BLE001 - one message's bug must not stop the control process
            self.metrics["handler_failed"] += 1
            log.exception("worker_message_handler_failed", type=type(msg).__name__, worker=link.worker)
        return True

    # ------------------------------------------------------------------ the lane
    def _on_lane_hello(self, link: WorkerLink | None, identity: bytes, msg: LaneHello) -> None:
        if link is None or link.lane != identity or link.epoch != msg.epoch:
            # before its Hello (two connections, no order between them), or a stale incarnation's
            self._early_lanes[identity] = msg.epoch
            return
        link.last_heard_ns = time.monotonic_ns()
        if not link.lane_up:
            link.lane_up = True
            log.info("worker_lane_up", worker=link.worker, held=len(link.held))
        held, link.held = link.held, []
        for m in held:
            self.send(link, m)

    def _give_up_lane(self, link: WorkerLink) -> None:
        """No LaneHello in time: everything for this incarnation goes to its Hello socket (one
        path from now on, so the device thread's commands keep their order)."""
        self.metrics["lanes_given_up"] += 1
        log.warning("worker_lane_not_up", worker=link.worker, lane=link.lane.decode(errors="replace"),
                    waited_s=self.cfg.lane_wait_s, held=len(link.held))
        if self._lanes.get(link.lane) is link:
            del self._lanes[link.lane]
        link.lane = None
        held, link.held = link.held, []
        for m in held:
            self.send(link, m)

    # ------------------------------------------------------------------ Hello and adoption
    def on_hello(self, link: WorkerLink, msg: Hello) -> None:
        if msg.epoch == link.epoch:      # the worker thought we restarted; query it again
            link.pool_gen, link.readers = msg.pool_gen, list(msg.readers)
            self._claim_disk(link, msg)
            self.query(link, recovery.to_query(self.state, link.worker, self.book))
            return
        self._on_hello_new(link.identity, msg)

    def _on_hello_new(self, identity: bytes, msg: Hello) -> None:
        w, now = msg.worker, time.monotonic_ns()
        if parse_worker_identity(identity) != w:
            self._reply_error(identity, ErrorReply(error=WORKER_MISMATCH,
                                                   detail=f"Hello from {identity[:32]!r} names worker {w}"))
            return
        if self.cfg.expected_workers is not None and w not in self.cfg.expected_workers:
            log.warning("unexpected_worker", worker=w, expected=self.cfg.expected_workers)
            self._reply_error(identity, ErrorReply(error=UNKNOWN_WORKER, detail=f"worker {w} is not expected here"))
            return
        wrong_group = self.check_group(w, msg.group, msg.rank, msg.ranks)
        if wrong_group is not None:
            log.error("worker_group_mismatch", worker=w, detail=wrong_group)
            self._reply_error(identity, ErrorReply(error=WORKER_MISMATCH, detail=wrong_group))
            return
        ws = self.state.workers.get(w)
        old = self.by_worker.get(w)
        found = msg.disk_blocks if self.cfg.keep_disk else ()
        waited = self._replacing.get(w)
        if old is not None and old.epoch != msg.epoch:
            self.lose(w, f"replaced by a new incarnation (epoch {msg.epoch})", found)
        elif ws is not None and ws.alive and self.roster.get(w) != msg.epoch and self._has_history(w):
            if waited is not None:
                why, expected = waited[1], False
            else:   # after a clean stop this is every start's expected step, not a warning
                why = "stopped with the server" if self._stopped_cleanly else "not back after the control restart"
                expected = self._stopped_cleanly
            self.lose(w, f"{why}; epoch {msg.epoch} replaces {self.roster.get(w)}", found,
                      expected=expected)
        ws = self.state.workers.get(w)
        if ws is not None and not ws.alive and self.roster.get(w) == msg.epoch:
            # NOTE: the ledger already wrote this incarnation off (its blocks are counted lost);
            # adopting it would bring back memory the ledger no longer accounts for.
            log.warning("lost_worker_returned", worker=w, epoch=msg.epoch)
            self._reply_error(identity, ErrorReply(error=WORKER_LOST, detail=f"worker {w} epoch {msg.epoch} was recorded lost"))
            try:
                self.router.send(identity, Shutdown(reason="recorded lost; a new incarnation replaces it"))
            except WorkerUnreachable:
                pass
            return
        lane = msg.lane.encode() if msg.lane else None
        link = WorkerLink(w, identity, msg.epoch, msg.device, now, lane)
        link.pool_gen, link.readers = msg.pool_gen, list(msg.readers)
        self._links[identity] = self.by_worker[w] = link
        if lane is not None:
            link.lane_by_ns = now + int(self.cfg.lane_wait_s * S)
            self._lanes[lane] = link
            if self._early_lanes.pop(lane, None) == msg.epoch:
                link.lane_up = True
        adopted = ws is not None and ws.alive and self.roster.get(w) == msg.epoch
        self._adopting.pop(w, None)
        self._replacing.pop(w, None)
        self.sizing[w] = msg.sizing            # an adopted worker's too (its books are in the ledger already)
        if adopted:
            log.info("worker_adopted", worker=w, epoch=msg.epoch)
        else:
            self.recorder.record(ev.WorkerJoined(worker=w, device=msg.device, tiers=dict(msg.tiers),
                                                 block_bytes=msg.block_bytes, device_owned=dict(msg.device_owned),
                                                 pinned_limit_bytes=msg.pinned_limit_bytes,
                                                 group=msg.group, rank=msg.rank),
                                 causation=recovery.join_causation(w, msg.epoch))
            self.roster[w] = msg.epoch
            self._record_memory(w, msg)
            log.info("worker_joined", worker=w, epoch=msg.epoch, device=msg.device, tiers=msg.tiers,
                     block_bytes=msg.block_bytes, device_owned=msg.device_owned,
                     pool_sizing=describe_sizing(msg.sizing))
        self._claim_disk(link, msg)
        self.query(link, recovery.to_query(self.state, w, self.book))
        self.on_joined(w)

    def _record_memory(self, w: int, msg: Hello) -> None:
        """A new incarnation's memory outside its blocks: its weights, and each pinned grant."""
        weights = msg.device_owned.get("weights")
        if msg.model and weights is not None:
            self.recorder.record(ev.WeightsLoaded(worker=w, arena="weights", model=msg.model, bytes=weights,
                                                  allocator_bytes=msg.weights_allocator_bytes,
                                                  tier_bytes=dict(msg.weights_tier_bytes),
                                                  checksum=msg.weights_checksum))
        for owner, nbytes in msg.pinned.items():
            self.recorder.record(ev.PinnedRegistered(worker=w, owner=owner, bytes=nbytes))

    def on_pinned_changed(self, link: WorkerLink, msg: PinnedChanged) -> None:
        """A grant made or given back after Hello (a resize grows or shrinks the index buffers)."""
        e = (ev.PinnedRegistered if msg.registered else ev.PinnedReleased)(worker=link.worker, owner=msg.owner,
                                                                             bytes=msg.bytes)
        self.recorder.record(e)

    def release_pinned(self, reason: str) -> None:
        """A clean stop: every joined worker is told to stop and gives back its pinned grants
        as it closes its mover; they leave the books here (a worker lost meanwhile is cleared by
        its WorkerLost)."""
        for w in list(self.by_worker):
            ws = self.state.workers.get(w)
            if ws is not None and ws.alive:
                for owner, nbytes in list(ws.pinned.items()):
                    self.recorder.record(ev.PinnedReleased(worker=w, owner=owner, bytes=nbytes))

    def _claim_disk(self, link: WorkerLink, msg: Hello) -> None:
        """Files an incarnation found on its disk at start and still offers: keep those the ledger
        has there (WorkerLost.kept_on_disk put them back), drop the rest. Once claimed the worker
        offers none, so a repeated claim (a Hello sent again) deletes nothing."""
        if msg.disk_blocks:
            wb = self.state.blocks.get(link.worker, {})
            self.send(link, ClaimDisk(keep=sorted(b for b in msg.disk_blocks if b in wb and "disk" in wb[b].tiers)))

    def _has_history(self, w: int) -> bool:
        return bool(self.state.blocks.get(w)) or any(
            m.worker == w for m in (*self.state.inflight.values(), *self.state.stranded.values()))

    def on_disk_claimed(self, link: WorkerLink, msg: DiskClaimed) -> None:
        """Files the ledger never had (or no longer has) on that disk, deleted by the worker: not
        in any account, so no event; counted and logged."""
        self.metrics["disk_files_dropped"] += len(msg.dropped)
        self.metrics["disk_bytes_dropped"] += msg.bytes_dropped
        log.info("disk_claimed", worker=link.worker, kept=len(msg.kept), dropped=len(msg.dropped),
                 bytes_dropped=msg.bytes_dropped)

    def on_pong(self, link: WorkerLink, msg: Pong) -> None:
        self.metrics["pongs"] += 1

    def on_worker_error(self, link: WorkerLink, msg: ErrorReply) -> None:
        self.metrics[f"worker_error_{msg.error}"] += 1
        log.warning("worker_error", worker=link.worker, error=msg.error, detail=msg.detail)

    # ------------------------------------------------------------------ heartbeats and loss
    def heartbeats(self, now: int) -> None:
        ping = Ping(nonce=now & 0x7FFFFFFF, ts_ns=time.time_ns())
        for link in list(self._links.values()):
            self.send(link, ping)
            if link.lane is not None and not link.lane_up and now > link.lane_by_ns:
                self._give_up_lane(link)
        for w, until in list(self._adopting.items()):
            if now > until:
                del self._adopting[w]
                why = f"did not come back within {self.cfg.adopt_grace_s} s of the control restart"
                if self._holds_disk(w):
                    self._await_replacement(w, "not back after the control restart", now)
                else:
                    self.lose(w, why)
            else:   # a surviving worker answers a ping; we answer unknown_worker; it says Hello again
                try:
                    self.router.send(worker_identity(w), ping)
                except WorkerUnreachable:
                    pass
        for w, (until, why) in list(self._replacing.items()):
            if now > until:
                self.lose(w, f"{why}; no new incarnation within {self.cfg.replace_wait_s} s")
        heard = {link.worker: link.last_heard_ns for link in self._links.values()}
        missed, lost = watchdog.silence(heard, now, int(self.cfg.heartbeat_missed_s * S), int(self.cfg.worker_lost_s * S),
                                        {lk.worker for lk in self._links.values() if lk.missed})
        for e in missed:
            self.by_worker[e.worker].missed = True
            log.warning("worker_heartbeat_missed", worker=e.worker, silent_ms=e.silent_ms)
            self.recorder.record(e)
        for w, silent_ms in lost:
            self.lose(w, f"heartbeat silent {silent_ms} ms")

    def exited(self, worker: int, epoch: int, returncode: int | None) -> None:
        """The supervisor saw the process of ``worker`` incarnation ``epoch`` exit."""
        ws = self.state.workers.get(worker)
        if self.roster.get(worker) != epoch or ws is None or not ws.alive or worker in self._replacing:
            return      # an incarnation already replaced, lost, or waited for
        why = (f"worker process exited with code {returncode}" if returncode is not None else
               "worker process exited (started before this control: its exit code is not ours to read)")
        if self._holds_disk(worker):
            self._await_replacement(worker, why, time.monotonic_ns())
        else:
            self.lose(worker, why)

    def _holds_disk(self, worker: int) -> bool:
        return self.cfg.keep_disk and any("disk" in st.tiers for st in self.state.blocks.get(worker, {}).values())

    def _await_replacement(self, worker: int, why: str, now: int) -> None:
        """The incarnation is gone, but its disk files may have outlived it: the next one says
        which it found and verified (Hello), and the loss is recorded then, keeping those.

        NOTE: until then the ledger still counts the worker alive. Its link is dropped at once,
        so the supervisor starts the next incarnation and nothing more is sent to the dead one;
        commands that commit meanwhile wait (MoveDispatcher) and its moves already sent are
        stranded at their deadline, both settled under the loss when it comes. ``on_gone`` lets
        the serving path answer the requests that ran there without waiting for the loss."""
        self._unlink(worker)
        self._adopting.pop(worker, None)
        self._replacing[worker] = (now + int(self.cfg.replace_wait_s * S), why)
        self.metrics["workers_awaiting_replacement"] += 1
        log.warning("worker_awaiting_replacement", worker=worker, why=why, wait_s=self.cfg.replace_wait_s)
        self.on_gone(worker)

    def _unlink(self, worker: int) -> None:
        link = self.by_worker.pop(worker, None)
        if link is not None:
            self._links.pop(link.identity, None)
            if link.lane is not None and self._lanes.get(link.lane) is link:
                del self._lanes[link.lane]

    def lose(self, worker: int, reason: str, found_on_disk: Collection[int] = (), expected: bool = False) -> None:
        self._unlink(worker)
        self._adopting.pop(worker, None)
        self._replacing.pop(worker, None)
        for e in watchdog.loss(self.state, worker, reason, self.book.undispatched, found_on_disk):
            if type(e) is ev.WorkerLost:
                self.busy.drop_worker(worker)
                (log.info if expected else log.warning)(
                    "worker_lost", worker=worker, reason=reason, blocks_lost=len(e.blocks_lost),
                    bytes_lost=e.bytes_lost, kept_on_disk=len(e.kept_on_disk), bytes_kept=e.bytes_kept)
                self.recorder.record(e)
            else:
                self.settle(e.move_id, e)
