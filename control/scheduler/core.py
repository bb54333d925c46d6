"""The serving scheduler: admission, page allocation, prefix reuse, restore-or-recompute. Pure.

It reads the folded ``State`` (where every page is, what is in flight, the device's limit) and
its own soft tables (session page order and keys, running requests), and returns values:

    plan(state, req)  ─► Admit   pages for the sequence, what to free first, what to restore,
                                 or another session's pages to share (``sharing.py``)
                      ─► Wait    not enough room now (which idle sessions to park to make it), or
                                 the worker already runs as many sequences as it batches
                      ─► Refuse  can never fit, or the session is busy (with the numbers)
    start(admit)      the request runs: its session is busy, its new pages are reserved
    written(...)      pages the worker filled (committed to the ledger by the caller)
    finish(...)       the session keeps the turn's pages (or only its reused prefix, when the
                      turn was cancelled or failed: the worker freed the rest)

Device room is counted as the worker will see it:

    limit (ceiling or capacity) ─ used (acked copies) ─ in flight toward the device
                                ─ reserved (pages of running requests not yet committed)

No clocks, sockets or threads: ``now_ns`` comes in as an argument.
"""
from __future__ import annotations

from typing import Callable

import msgspec

from residency.control.budget import limit_bytes
from residency.control.dial import closed as pool_closed
from residency.control.policy.proposals import busy_blocks
from residency.control.scheduler.config import SchedulerConfig
from residency.control.scheduler.cost import CostModel, PrefixDecision
from residency.control.scheduler.prefix import num_matching_pages, pages_needed
from residency.control.scheduler.sessions import SessionEntry, restore_plan
from residency.control.scheduler.sharing import find_shared_prefix
from residency.control.state import State


class PendingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A tokenized request waiting to be admitted: what ``plan`` weighs."""

    request_id: str
    session: str | None
    worker: int
    prompt_tokens: int
    prompt_keys: list[str]            # content keys of the prompt's full pages
    max_tokens: int                   # resolved (never 0)


class Admit(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    session: str | None
    worker: int
    blocks: list[int]                 # every page of the sequence, in order
    num_cached_tokens: int            # leading positions already computed (whole pages)
    reused: list[int]                 # the first pages of ``blocks``: the session's prefix
    restore: dict[str, list[int]]     # source tier -> reused pages to bring back first
    drop: dict[str, list[int]]        # tier -> session pages to free first (not reused)
    decision: PrefixDecision | None   # set when a parked prefix was priced
    restored_tokens: int
    new_blocks: list[int]
    shared: list[int] = []            # another session's pages holding the prompt's first positions
    shared_from: str | None = None    # that session
    copied: bool = False              # copied into the first new pages (a session's turn) or read in place


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    reason: str
    code: str = "insufficient_kv_capacity"    # the refusal's code should the wait time out
    park: list[str] = []              # idle sessions whose device pages would make room
    needed_blocks: int = 0
    free_blocks: int = 0


class Refuse(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    status: int                       # the HTTP status the API answers with
    code: str
    reason: str
    needed_blocks: int = 0
    available_blocks: int = 0


class Running(msgspec.Struct, kw_only=True):
    request_id: str
    session: str | None
    worker: int
    reused: list[int]
    new_blocks: list[int]
    shared: list[int] = []            # another session's pages it reads (or copies): held while it runs
    copied: bool = False
    written: list[int] = []
    written_keys: list[str] = []


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cost: CostModel | None = None,
                 allocate: Callable[[int, int], list[int]] | None = None):
        """``allocate(worker, n)``: the control process's block-id allocator (one for every
        producer of blocks); without it, ids continue above the ledger's highest."""
        self.cfg = cfg
        self.cost = cost or CostModel()
        self._allocate = allocate
        self.sessions: dict[str, SessionEntry] = {}
        self.running: dict[str, Running] = {}
        self._next_block: dict[int, int] = {}
        self.max_seqs: dict[int, int] = {}      # worker -> sequences it batches at once (ServingReady)
        self.decisions: dict[str, int] = {"restore": 0, "recompute": 0}

    # ------------------------------------------------------------------ queries
    def device_room(self, state: State, worker: int) -> tuple[int, int]:
        """(limit pages, free pages) of the worker's device tier, as the next admission sees it."""
        ws = state.workers[worker]
        bb = ws.block_bytes
        acc = ws.tiers["device"]
        limit = limit_bytes(acc) // bb
        inflight = -(-acc.inflight_in_bytes // bb)
        wb = state.blocks.get(worker, {})
        reserved = sum(1 for r in self.running.values() if r.worker == worker for b in r.new_blocks if b not in wb)
        return limit, limit - acc.used_bytes // bb - inflight - reserved

    def busy_blocks(self) -> dict[int, set[int]]:
        """Pages running requests read or write: no move may take them off the device."""
        out: dict[int, set[int]] = {}
        for r in self.running.values():
            out.setdefault(r.worker, set()).update(r.reused)
            out[r.worker].update(r.new_blocks)
            out[r.worker].update(r.shared)
        return out

    def busy_sessions(self) -> set[str]:
        return {s for s, e in self.sessions.items() if e.busy is not None}

    # ------------------------------------------------------------------ block ids
    def allocate_ids(self, state: State, worker: int, n: int) -> list[int]:
        """Fresh logical page ids: never one the ledger or a running request has used."""
        if self._allocate is not None:
            return self._allocate(worker, n)
        nxt = self._next_block.get(worker)
        if nxt is None:
            wb = state.blocks.get(worker, {})
            nxt = (max(wb) + 1) if wb else 0
        ids = list(range(nxt, nxt + n))
        self._next_block[worker] = nxt + n
        return ids

    def reserve_ids_above(self, worker: int, block_id: int) -> None:
        """Someone else (an operator's CommitBlocks) used ``block_id``: never hand it out."""
        if self._next_block.get(worker, 0) <= block_id:
            self._next_block[worker] = block_id + 1

    def set_max_seqs(self, worker: int, n: int) -> None:
        """The worker runs at most ``n`` sequences at once (0: it did not say): more wait."""
        if n > 0:
            self.max_seqs[worker] = n
        else:
            self.max_seqs.pop(worker, None)

    # ------------------------------------------------------------------ admission
    def plan(self, state: State, req: PendingRequest) -> Admit | Wait | Refuse:
        cfg, P, w = self.cfg, self.cfg.page_tokens, req.worker
        ws = state.workers.get(w)
        if ws is None or not ws.alive:
            return Refuse(request_id=req.request_id, status=503, code="worker_unavailable",
                          reason=f"worker {w} is not serving")
        closed = pool_closed(state, w)
        if closed is not None:           # a rebind in progress, or torn: nothing is placed on the pool
            return Wait(request_id=req.request_id, code=closed[0], reason=closed[1])
        entry = self.sessions.get(req.session) if req.session else None
        if entry is not None and entry.busy is not None:
            return Refuse(request_id=req.request_id, status=409, code="session_busy",
                          reason=f"session {req.session!r} is generating for request {entry.busy}; "
                                 "send the next turn when it has finished")
        held_keys: list[str] = []
        held_blocks: list[int] = []
        if entry is not None:
            if entry.worker == w:
                present = entry.present_prefix(state)
                held_blocks, held_keys = entry.blocks[:present], entry.keys[:present]
            moving = busy_blocks(state).get(entry.worker, set())
            if any(b in moving for b in entry.blocks):
                return Wait(request_id=req.request_id, reason=f"a move of session {req.session!r} is in flight")
        batch = self.max_seqs.get(w, 0)
        if batch and sum(1 for r in self.running.values() if r.worker == w) >= batch:
            return Wait(request_id=req.request_id, code="server_overloaded",
                        reason=f"worker {w} is running {batch} sequences, the most it batches")

        n = num_matching_pages(held_keys, req.prompt_keys, req.prompt_tokens, P)
        wb = state.blocks.get(w, {})
        reused, restore = restore_plan(wb, held_blocks[:n])
        decision = self._priced(ws, restore, len(reused), req.prompt_tokens) if restore else None
        if decision is not None and decision.choice == "recompute":
            reused, restore = [], {}
        n = len(reused)

        shared: list[int] = []
        donor = None
        if n == 0 and cfg.share_prefixes:        # another session's pages: resident, or brought back first
            donor, found = find_shared_prefix(
                self.sessions.values(), state, w, exclude=req.session, prompt_keys=req.prompt_keys,
                prompt_tokens=req.prompt_tokens, page_tokens=P, moving=busy_blocks(state).get(w, set()))
            shared, restore = restore_plan(wb, found)
            if restore:
                decision = self._priced(ws, restore, len(shared), req.prompt_tokens)
                if decision.choice == "recompute":
                    shared, restore = [], {}
            donor = donor if shared else None
        copied = bool(shared) and req.session is not None

        drop: dict[str, list[int]] = {}
        if entry is not None:
            for b in entry.blocks:
                st = wb.get(b)
                if st is None or b in reused:
                    continue
                for t in st.tiers:
                    drop.setdefault(t, []).append(b)
            read = [b for b in drop.get("device", []) if b in self.busy_blocks().get(w, set())]
            if read:
                return Wait(request_id=req.request_id,
                            reason=f"pages {read[:8]} of session {req.session!r} are read by a running request")

        total = pages_needed(req.prompt_tokens, req.max_tokens, P)
        num_new = total - n - (0 if copied else len(shared))
        num_restore = sum(len(bl) for bl in restore.values())
        needed = num_new + num_restore
        limit, free = self.device_room(state, w)
        if needed > limit:      # never seated while the pool is this size: answered now, never held
            written = req.prompt_tokens + max(0, req.max_tokens - 1)
            return Refuse(request_id=req.request_id, status=503, code="insufficient_kv_capacity",
                          reason=(f"the sequence needs {needed} pages on the device ({total} = ceil((prompt "
                                  f"{req.prompt_tokens} + max_tokens {req.max_tokens} - 1 = {written} tokens) / "
                                  f"page_tokens {P}), {total - num_new} reused, {num_restore} of those to restore); "
                                  f"its limit is {limit} pages of worker {w}'s device pool now"),
                          needed_blocks=needed, available_blocks=free)
        if needed > free:
            short = needed - free
            park: list[str] = []
            busy = busy_blocks(state).get(w, set())
            idle = sorted((e for e in self.sessions.values()
                           if e.busy is None and e.session != req.session and e.worker == w),
                          key=lambda e: e.last_used_ns)
            for e in idle:
                on_device = [b for b in e.blocks if b in wb and "device" in wb[b].tiers and b not in busy]
                if on_device:
                    park.append(e.session)
                    short -= len(on_device)
                    if short <= 0:
                        break
            return Wait(request_id=req.request_id, park=park, needed_blocks=needed, free_blocks=free,
                        reason=f"needs {needed} device pages, {free} free")

        new_blocks = self.allocate_ids(state, w, num_new)
        if decision is not None:
            self.decisions[decision.choice] += 1
        if shared:
            self.decisions["shared"] = self.decisions.get("shared", 0) + 1
        return Admit(
            request_id=req.request_id, session=req.session, worker=w,
            blocks=reused + ([] if copied else shared) + new_blocks,
            num_cached_tokens=(n + len(shared)) * P, reused=reused, restore=restore, drop=drop, decision=decision,
            restored_tokens=num_restore * P, new_blocks=new_blocks, shared=shared, shared_from=donor, copied=copied,
        )

    def _priced(self, ws, restore: dict[str, list[int]], cached_pages: int, prompt_tokens: int) -> PrefixDecision:
        """Restore ``restore`` (tier -> pages) or recompute those ``cached_pages``: the cost model's
        choice, or the configured policy's."""
        P = self.cfg.page_tokens
        decision = self.cost.decide(cached_tokens=cached_pages * P, new_tokens=prompt_tokens - cached_pages * P,
                                    bytes_by_tier={t: len(bl) * ws.block_bytes for t, bl in restore.items()})
        if self.cfg.restore_policy != "cost":
            decision = msgspec.structs.replace(decision, choice=self.cfg.restore_policy,
                                               reason=f"restore_policy={self.cfg.restore_policy}; " + decision.reason)
        return decision

    # ------------------------------------------------------------------ lifecycle
    def start(self, admit: Admit, now_ns: int) -> None:
        self.running[admit.request_id] = Running(
            request_id=admit.request_id, session=admit.session, worker=admit.worker,
            reused=list(admit.reused), new_blocks=list(admit.new_blocks), shared=list(admit.shared),
            copied=admit.copied,
        )
        if admit.session is not None:
            entry = self.sessions.get(admit.session)
            if entry is None:
                entry = self.sessions[admit.session] = SessionEntry(session=admit.session, worker=admit.worker)
            n = len(admit.reused)
            entry.worker = admit.worker
            entry.blocks, entry.keys = list(admit.reused), list(entry.keys[:n])
            entry.num_tokens = n * self.cfg.page_tokens
            entry.busy = admit.request_id
            entry.last_used_ns = now_ns

    def written(self, request_id: str, blocks: list[int], keys: list[str]) -> None:
        r = self.running.get(request_id)
        if r is None:
            return
        for b, k in zip(blocks, keys):
            if b in r.new_blocks and b not in r.written:
                r.written.append(b)
                r.written_keys.append(k)

    def positions_written(self, request_id: str, num_generated: int, prompt_tokens: int) -> int:
        """Positions of a running request whose KV is written: the prompt and every generated
        token but the last (sampled, not yet fed back); while the prompt is still prefilling, the
        full pages reported so far."""
        if num_generated:
            return prompt_tokens + num_generated - 1
        r = self.running.get(request_id)
        return (len(r.reused) + len(r.written)) * self.cfg.page_tokens if r is not None else 0

    def progress(self, request_id: str, num_tokens: int) -> None:
        """A running session turn wrote more KV: its session holds ``num_tokens`` positions now."""
        r = self.running.get(request_id)
        entry = self.sessions.get(r.session) if r is not None and r.session is not None else None
        if entry is not None and entry.busy == request_id:
            entry.num_tokens = num_tokens

    def finish(self, request_id: str, reason: str, num_tokens: int, now_ns: int) -> None:
        """The request ended (``reason``: stop, length, cancelled, error). A session turn that
        finished keeps its pages for the next turn; otherwise the session keeps only the prefix it
        reused (the worker freed what the request wrote: ``Generate.free_on_finish``)."""
        r = self.running.pop(request_id, None)
        if r is None or r.session is None:
            return
        entry = self.sessions[r.session]
        entry.busy = None
        entry.last_used_ns = now_ns
        n = len(r.reused)
        if reason in ("stop", "length"):
            order = {b: i for i, b in enumerate(r.new_blocks)}
            pairs = sorted(zip(r.written, r.written_keys), key=lambda p: order[p[0]])
            entry.blocks = list(r.reused) + [b for b, _ in pairs]
            entry.keys = entry.keys[:n] + [k for _, k in pairs]
            entry.num_tokens = num_tokens
        else:
            entry.blocks, entry.keys = list(r.reused), entry.keys[:n]
            entry.num_tokens = n * self.cfg.page_tokens

    def recompute_instead(self, state: State, request_id: str) -> Admit:
        """A restore that failed (refused, rejected, checksum): compute the whole prompt instead.
        The session's own prefix pages are given up (``drop``; a shared prefix stays its donor's),
        fresh pages take their place."""
        r = self.running[request_id]
        wb = state.blocks.get(r.worker, {})
        drop: dict[str, list[int]] = {}
        for b in r.reused:
            for t in (wb[b].tiers if b in wb else ()):
                drop.setdefault(t, []).append(b)
        fresh = self.allocate_ids(state, r.worker, len(r.reused) + (0 if r.copied else len(r.shared)))
        r.reused, r.shared, r.new_blocks = [], [], fresh + r.new_blocks
        if r.session is not None:
            entry = self.sessions[r.session]
            entry.blocks, entry.keys, entry.num_tokens = [], [], 0
        self.decisions["restore_failed"] = self.decisions.get("restore_failed", 0) + 1
        return Admit(request_id=request_id, session=r.session, worker=r.worker, blocks=list(r.new_blocks),
                     num_cached_tokens=0, reused=[], restore={}, drop=drop, decision=None, restored_tokens=0,
                     new_blocks=list(r.new_blocks))

    def rebuild(self, state: State) -> None:
        """After a restart: sessions from the ledger (pages with a session, in id order, which is
        sequence order because ids only grow), so a surviving worker's pages are reused."""
        for w, wb in state.blocks.items():
            by_session: dict[str, list[int]] = {}
            for b, st in wb.items():
                if st.session is not None:
                    by_session.setdefault(st.session, []).append(b)
            for session, blocks in by_session.items():
                blocks.sort()
                keys = [wb[b].key for b in blocks]
                full = next((i for i, k in enumerate(keys) if not k), len(keys))
                self.sessions[session] = SessionEntry(session=session, worker=w, blocks=blocks, keys=keys,
                                                      num_tokens=self._held_tokens(state, session, full, len(blocks)))

    def _held_tokens(self, state: State, session: str, num_full: int, num_pages: int) -> int:
        """Positions a rebuilt session's pages hold: its full pages, plus what its partial last
        page holds when the ledger said (its last commit's ``session_tokens``)."""
        P = self.cfg.page_tokens
        sess = state.sessions.get(session)
        said = sess.num_tokens if sess is not None else None
        if num_pages == num_full + 1 and said is not None and num_full * P < said <= (num_full + 1) * P:
            return said
        return num_full * P

    def prune(self, state: State, now_ns: int, idle_ns: int) -> list[str]:
        """Forget sessions that hold no page any more and have been idle ``idle_ns``."""
        gone = [s for s, e in self.sessions.items()
                if e.busy is None and now_ns - e.last_used_ns > idle_ns and e.present_prefix(state) == 0]
        for s in gone:
            del self.sessions[s]
        return gone

    def forget_session(self, session: str) -> None:
        """The session's pages were all freed (deleted by hand): its next turn starts from nothing."""
        self.sessions.pop(session, None)

    def forget_blocks(self, worker: int, blocks: set[int]) -> None:
        """Pages that no longer exist (freed by an operator, lost with a worker): cut every
        session's chain at the first one."""
        for e in self.sessions.values():
            if e.worker != worker:
                continue
            for i, b in enumerate(e.blocks):
                if b in blocks:
                    e.truncate(i, self.cfg.page_tokens)
                    break
