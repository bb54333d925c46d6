"""The serving path of a tensor-parallel group (``serve --tp N``): the leader is served, every
rank is accounted, the ranks' steps are compared. Loop thread only.

    ServingReady   a follower's is noted; the leader's is held until every rank has said it
                   (the group serves once all its ranks do)
    TokensGenerated  the leader's drive the request's stream; each follower's record only its
                   own pages (BlocksCommitted / BlocksFreed on that rank's books). A sequence
                   that fails on one rank alone (a restore of its shard, say) is cancelled on
                   every other rank, and the client is answered the error naming that rank: a
                   sequence one rank dropped is never agreed again, so it would wait forever
    StepCompleted  every rank's is recorded and compared (control/groups.py StepDigests): the
                   first step whose digests differ records GroupDiverged and GroupStopped
    StepRefused    the ranks' ballots split before a step, which no rank ran: once every earlier
                   step is judged, GroupDiverged(caught_by="ballot") and GroupStopped naming the
                   ballot and the request (each rank tells the same verdict; the first one counts)
    WorkerLost     of any rank: GroupStopped naming the rank and the group's blocks it held
    a torn flip    of the group's weights (control/flip_group.py): GroupStopped naming each rank's state

A stopped group serves no more: its running requests end with 503 ``group_stopped`` (their
pages freed by a cancel on every rank), and new ones are answered 503 naming the group and the
step, never served by what one rank alone would do.
"""
from __future__ import annotations

import time

import structlog

from residency.control.groups import GroupBook, StepDigests, step_digest
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, ServingReady, StepRefused, TokensGenerated

log = structlog.get_logger("control.groups")
FREE_REASON = {"stop": "finished", "length": "finished", "error": "error"}


class GroupServing:
    def __init__(self, proc, service, book: GroupBook):
        self.proc = proc
        self.service = service
        self.book = book
        self.digests = StepDigests(book)
        self.ready: dict[str, dict[int, tuple]] = {g: {} for g in book.members}   # group -> worker -> (link, msg)
        self.stopped: dict[str, ev.GroupStopped] = {}
        for msg_type, handler in ((ServingReady, self.on_ready), (TokensGenerated, self.on_tokens),
                                  (ev.StepCompleted, self.on_step), (StepRefused, self.on_refused)):
            proc.on_worker_message(msg_type, handler)
        proc.add_listener(self._on_recorded)
        # NOTE: chained before the serving path's own: a rank's process gone stops the group at
        # once, even while its loss waits for a next incarnation (its disk copies): the ranks left
        # would otherwise wait in every round for a peer that will not post
        gone = proc.worker_gone
        proc.worker_gone = lambda worker: (self._gone(worker), gone(worker))

    # ------------------------------------------------------------------ readiness
    def on_ready(self, link, msg: ServingReady) -> None:
        g = self.book.group_of.get(link.worker)
        if g is None:
            self.service.on_ready(link, msg)
            return
        self.ready[g][link.worker] = (link, msg)
        if self.book.is_follower(link.worker):      # its own arena and models, for the group's flips
            self.service.flips.on_ready(link.worker, msg)
        if g in self.stopped or len(self.ready[g]) < len(self.book.members[g]):
            return
        leader = self.book.leader(g)
        self.service.on_ready(*self.ready[g][leader])
        log.info("group_serving", group=g, ranks=len(self.book.members[g]))

    # ------------------------------------------------------------------ tokens and pages
    def on_tokens(self, link, msg: TokensGenerated) -> None:
        if not self.book.is_follower(link.worker):
            self.service.streams.on_tokens(link, msg)
            if msg.finish_reason == "error" and link.worker in self.book.group_of:
                self._failed_alone(link.worker, msg)
            return
        if msg.finish_reason == "error":
            self._failed_alone(link.worker, msg)
        # a rank's own pages, on its own books; the request's stream is the leader's
        w = link.worker
        bb = self.proc.state.workers[w].block_bytes
        if msg.blocks_written:
            self.proc.record(ev.BlocksCommitted(worker=w, session=None, tier="device", blocks=list(msg.blocks_written),
                                                keys=list(msg.keys_written), bytes=len(msg.blocks_written) * bb),
                             correlation=msg.request_id)
        if msg.blocks_freed:
            reason = msg.finish_reason or "error"
            self.proc.record(ev.BlocksFreed(worker=w, tier="device", blocks=list(msg.blocks_freed),
                                            bytes=msg.bytes_freed, reason=FREE_REASON.get(reason, reason)),
                             correlation=msg.request_id)

    def _failed_alone(self, worker: int, msg: TokensGenerated) -> None:
        """One rank ended a sequence with an error: every other rank still holding it is told to
        cancel it (through the leader, which fans out), and the client's answer names the rank."""
        g, rank = self.book.group_of[worker], self.book.rank_of(worker)
        r = self.service.requests.get(msg.request_id)
        if r is not None and r.rank_failed is None:
            r.rank_failed = f"rank {rank} (worker {worker}) of group {g} failed it: {msg.error}"
        log.error("group_sequence_failed_on_a_rank", group=g, rank=rank, worker=worker, request_id=msg.request_id,
                  error=msg.error)
        cancel = CancelGenerate(request_id=msg.request_id, reason="rank_failed")
        for w in self.book.members[g]:
            if w != worker and (ws := self.proc.state.workers.get(w)) is not None and ws.alive:
                self.proc.workers.send_to_worker(w, cancel)

    # ------------------------------------------------------------------ steps
    def on_step(self, link, msg: ev.StepCompleted) -> None:
        if self.book.is_follower(link.worker):
            self.proc.record(msg)
        else:
            self.service.on_step(link, msg)
        g = self.book.group_of.get(link.worker)
        if g is None or g in self.stopped:
            return
        live = {w for w in self.book.members[g] if (ws := self.proc.state.workers.get(w)) is not None and ws.alive}
        diverged = self.digests.observe(link.worker, msg.step, step_digest(msg), live)
        self._diverged(g, diverged or self.digests.released(g))

    def on_refused(self, link, msg: StepRefused) -> None:
        g = self.book.group_of.get(link.worker)
        if g is None:
            log.warning("step_refused_outside_a_group", worker=link.worker, request_id=msg.request_id)
            return
        if g not in self.stopped:
            self._diverged(g, self.digests.ballot(link.worker, msg))

    def _diverged(self, g: str, diverged: ev.GroupDiverged | None) -> None:
        if diverged is None:
            return
        self.proc.record(diverged)
        log.error("group_diverged", group=g, step=diverged.step, caught_by=diverged.caught_by,
                  request_id=diverged.request_id, digests=diverged.digests_by_rank)
        split = ", ".join(f"worker {w}={d}" for w, d in diverged.digests_by_rank.items())
        if diverged.caught_by == "ballot":
            what = f"request {diverged.request_id}" if diverged.request_id else "an unreadable ballot"
            reason = (f"ranks' ballots differ for {what} at round {diverged.round}, before step {diverged.step} "
                      f"ran on any rank: {split}")
        else:
            reason = f"ranks diverged at step {diverged.step}: {split}"
        self.stop(g, reason, step=diverged.step)

    # ------------------------------------------------------------------ stop
    def _on_recorded(self, seq: int, event) -> None:
        if type(event) is not ev.WorkerLost:
            return
        g = self.book.group_of.get(event.worker)
        if g is None:
            return
        rank = self.book.rank_of(event.worker)
        lost = sorted(event.blocks_lost)
        reason = (f"rank {rank} (worker {event.worker}) lost: {event.reason}; its shard of {len(lost)} block(s) "
                  "of the group is gone")
        log.error("group_rank_lost", group=g, rank=rank, worker=event.worker, blocks=len(lost))
        if g in self.stopped:      # stopped already: the loss and the blocks it cost are still a fact of the group
            self.proc.record(ev.GroupStopped(group=g, reason=f"{reason} (serving had stopped: "
                                                                f"{self.stopped[g].reason})", blocks=lost))
            return
        self.stop(g, reason, blocks=lost)

    def _gone(self, worker: int) -> None:
        g = self.book.group_of.get(worker)
        if g is not None and g not in self.stopped:
            self.stop(g, f"rank {self.book.rank_of(worker)} (worker {worker}): its process exited")

    def stop_of(self, worker: int, reason: str) -> None:
        """Stop the group ``worker`` leads or serves in, unless it is stopped already."""
        g = self.book.group_of.get(worker)
        if g is not None and g not in self.stopped:
            self.stop(g, reason)

    def stop(self, group: str, reason: str, *, step: int | None = None, blocks: list[int] | None = None) -> None:
        """The group serves no more: recorded, its requests answered 503, new ones refused naming it."""
        e = ev.GroupStopped(group=group, reason=reason, step=step, blocks=list(blocks or []))
        self.stopped[group] = e
        self.book.stopped.add(group)
        self.proc.record(e)
        leader = self.book.leader(group)
        at = f" at step {step}" if step is not None else ""
        message = f"group {group} stopped{at}: {reason}"
        self.service.workers.close(leader, "group_stopped", message)
        self.service.streams.worker_stopped(leader, "group_stopped", message)
        log.error("group_stopped", group=group, step=step, reason=reason, at_ns=time.time_ns())


__all__ = ["GroupServing"]
