"""Sessions by hand (the admin routes: look, list, park, restore, delete) and the retention
budget of prefixes kept for requests outside a session.

Loop thread only. It reads where pages are from the folded state, and what a session holds from
the scheduler's table; every move it needs is asked of the control process (``Asker``).
"""
from __future__ import annotations

import structlog

from residency.control.scheduler.asker import Asker, answer_error
from residency.control.scheduler.port import BackendError, SessionInfo, UnknownSession
from residency.control.scheduler.retain import is_retained, retained_bytes
from residency.control.scheduler.sessions import tier_of
from residency.control.scheduler.workers import ServingWorkers
from residency.events import catalog as ev
from residency.events.catalog import TIERS
from residency.events.asks import AskAnswered, AskMove, AskReleaseBlocks

log = structlog.get_logger("control.serving")
FAILED = (ev.MoveFailed, ev.MoveRejected, ev.MoveRefused, ev.MoveStranded, ev.MoveAbandoned)


class SessionBook:
    def __init__(self, proc, workers: ServingWorkers, asker: Asker, *, retain_fraction: float):
        self.proc = proc
        self.workers = workers
        self.asker = asker
        self.retain_fraction = retain_fraction       # of the host tier: prefixes kept for requests outside a session
        self._evicting: set[str] = set()             # retained sessions whose delete is under way

    def _entry(self, session: str):
        sched = self.workers.sched
        return sched.sessions.get(session) if sched is not None else None

    def _session_pages(self, session: str) -> tuple[int | None, list[int]]:
        for w, wb in self.proc.state.blocks.items():
            pages = [b for b, st in wb.items() if st.session == session]
            if pages:
                return w, sorted(pages)
        entry = self._entry(session)
        return (entry.worker if entry else None), []

    def info(self, session: str, move_id: str | None = None, note: str | None = None) -> SessionInfo:
        w, pages = self._session_pages(session)
        entry = self._entry(session)
        if entry is None and not pages:
            raise UnknownSession(session)
        return self._describe(session, w, pages, move_id, note)

    def list_sessions(self, limit: int) -> tuple[list[SessionInfo], int]:
        """Every session the ledger or the scheduler knows (the most recently used first, up to
        ``limit``) and how many there are: one pass over the blocks."""
        found: dict[str, tuple[int, list[int]]] = {}
        for w, wb in self.proc.state.blocks.items():
            for b, st in wb.items():
                if st.session is not None:
                    found.setdefault(st.session, (w, []))[1].append(b)
        known = self.workers.sched.sessions if self.workers.sched is not None else {}
        infos = []
        for name in set(found) | set(known):
            w, pages = found.get(name) or (known[name].worker, [])
            infos.append(self._describe(name, w, sorted(pages)))
        infos.sort(key=lambda i: (-i.last_used_ns, i.session))
        return infos[:limit], len(infos)

    def _describe(self, session: str, w: int | None, pages: list[int], move_id: str | None = None,
                  note: str | None = None) -> SessionInfo:
        entry = self._entry(session)
        ws = self.proc.state.workers.get(w) if w is not None else None
        wb = self.proc.state.blocks.get(w, {}) if w is not None else {}
        by_tier = {t: sum(1 for b in pages if t in wb[b].tiers) for t in TIERS}
        return SessionInfo(
            session=session, tier=tier_of(self.proc.state, w, pages) if pages else None, num_blocks=len(pages),
            num_tokens=entry.num_tokens if entry else 0, bytes=len(pages) * (ws.block_bytes if ws else 0),
            busy=bool(entry and entry.busy), last_used_ns=entry.last_used_ns if entry else 0, move_id=move_id,
            blocks_by_tier=by_tier, note=note)

    def park(self, session: str, tier: str, done) -> None:
        self.info(session)
        entry = self._entry(session)
        if entry is not None and entry.busy:
            raise BackendError(409, f"session {session!r} is generating; park it when it is idle",
                               code="session_busy", param="session_id")
        self._not_read(session, *self._session_pages(session), "park")
        moved: list[str] = []

        def step(ans: AskAnswered | None) -> None:
            try:
                advance(ans)
            except BackendError as e:
                done(e)

        def advance(ans: AskAnswered | None) -> None:
            if ans is not None:
                if ans.error is not None or any(type(e) is ev.MoveRefused for e in ans.events):
                    done(answer_error(ans))
                    return
                moved.extend(ans.move_ids)
            w, pages = self._session_pages(session)
            wb = self.proc.state.blocks.get(w, {})
            on_device = [b for b in pages if "device" in wb[b].tiers]
            on_host = [b for b in pages if "host" in wb[b].tiers and "disk" not in wb[b].tiers]
            if on_device:
                self.asker.ask(AskMove(ask_id=self.asker.new_id("park"), kind="park", worker=w, blocks=on_device,
                                       session=session), "operator", step)
            elif tier == "disk" and on_host:
                self.asker.ask(AskMove(ask_id=self.asker.new_id("demote"), kind="demote", worker=w,
                                       blocks=on_host, session=session), "operator", step)
            else:
                where = self.info(session)
                off = "on the device" if tier == "host" else "on the device or only on host"
                note = None if moved else (f"nothing moved: no page of {session!r} is {off} "
                                           f"(pages by tier: {where.blocks_by_tier})")
                done(self.info(session, moved[-1] if moved else None, note))
        step(None)

    def _not_read(self, session: str, worker: int | None, pages: list[int], what: str) -> None:
        """409 if a running request reads some of the session's pages (a prefix it shares)."""
        if self.workers.sched is None or worker is None:
            return
        mine = set(pages)
        readers = sorted(r.request_id for r in self.workers.sched.running.values()
                         if r.worker == worker and r.session != session and mine.intersection(r.shared))
        if readers:
            raise BackendError(409, f"pages of session {session!r} are read by running request(s) {readers[:4]} "
                                    f"(a prefix they share); {what} it when they have finished",
                               code="session_in_use", param="session_id")

    def evict_retained(self) -> None:
        """Past the retention budget (``retain_fraction`` of the host tier), delete retained
        prefixes by the book, least recently used first; one read by a running request is skipped."""
        state = self.proc.state
        cap = int(self.retain_fraction * sum(ws.tiers["host"].capacity_bytes for ws in state.workers.values()
                                             if ws.alive and "host" in ws.tiers))
        kept = sorted((e for e in self.workers.sched.sessions.values() if is_retained(e.session)),
                      key=lambda e: e.last_used_ns)
        held = {e.session: retained_bytes(e, state, state.workers[e.worker].block_bytes) for e in kept
                if e.worker in state.workers}
        total = sum(b for name, b in held.items() if name not in self._evicting)
        for e in kept:
            if total <= cap:
                break
            if e.busy is not None or e.session in self._evicting or e.session not in held:
                continue
            try:
                self.delete(e.session, lambda res, name=e.session: self._retained_evicted(name, res),
                            why=f"retained prefix {e.session} evicted: {total} bytes retained, budget {cap}")
            except BackendError as err:
                log.info("retained_prefix_kept", session=e.session, why=str(err))
                continue
            self._evicting.add(e.session)
            total -= held[e.session]

    def _retained_evicted(self, session: str, result) -> None:
        self._evicting.discard(session)
        if isinstance(result, BackendError):
            log.warning("retained_prefix_eviction_failed", session=session, error=str(result))
        else:
            log.info("retained_prefix_evicted", session=session, bytes_freed=result[1])

    def delete(self, session: str, done, why: str | None = None) -> None:
        """Free every copy of a session's pages, tier by tier, by the book (each a release the
        ledger records), then forget the session. Its next turn starts from nothing."""
        info = self.info(session)
        entry = self._entry(session)
        if entry is not None and entry.busy:
            raise BackendError(409, f"session {session!r} is generating; delete it when it is idle",
                               code="session_busy", param="session_id")
        w, pages = self._session_pages(session)
        self._not_read(session, w, pages, "delete")
        wb = self.proc.state.blocks.get(w, {})
        by_tier: dict[str, list[int]] = {}
        for b in pages:
            for t in wb[b].tiers:
                by_tier.setdefault(t, []).append(b)
        left = sorted(by_tier)
        freed = [0]

        def step(ans: AskAnswered | None) -> None:
            if ans is not None:
                failed = next((e for e in ans.events if type(e) in FAILED), None)
                if ans.error is not None or failed is not None:
                    done(answer_error(ans) if failed is None else BackendError(
                        503, f"the release of {session!r}'s pages failed ({type(failed).__name__}: "
                             f"{getattr(failed, 'reason', '') or getattr(failed, 'error', '')}); "
                             f"{freed[0]} bytes were freed before it", type="server_error", code="release_failed"))
                    return
                freed[0] += sum(e.bytes for e in ans.events if type(e) is ev.CopiesReleased)
            if left:
                t = left.pop()
                self.asker.ask(AskReleaseBlocks(ask_id=self.asker.new_id("delete"), worker=w, tier=t,
                                                blocks=by_tier[t], reason=why or f"session {session} deleted",
                                                session=session),
                               "operator", step)
                return
            self.proc.record(ev.SessionDeleted(session=session, worker=w, bytes_freed=freed[0],
                                               reason=why or "operator"), correlation=session)
            if self.workers.sched is not None:
                self.workers.sched.forget_session(session)
            done((info, freed[0]))
        step(None)

    def restore(self, session: str, done) -> None:
        self.info(session)
        w, pages = self._session_pages(session)
        wb = self.proc.state.blocks.get(w, {})
        off = [b for b in pages if "device" not in wb[b].tiers]
        if not off:
            done(self.info(session, note=f"nothing moved: every page of {session!r} is already on the device"))
            return
        if self.workers.sched is not None:
            # NOTE: the budget authority funds a restore against acked bytes only; the pages that
            # running requests reserved (not yet written) are known here, so check them first.
            _, free = self.workers.sched.device_room(self.proc.state, w)
            if len(off) > free:
                raise BackendError(503, f"the device has room for {free} pages now; restoring {session!r} "
                                        f"needs {len(off)}", type="server_error", code="insufficient_kv_capacity")

        def answered(ans: AskAnswered) -> None:
            if ans.error is not None or any(type(e) is ev.MoveRefused for e in ans.events):
                done(answer_error(ans))
                return
            try:
                done(self.info(session, ans.move_ids[-1] if ans.move_ids else None))
            except BackendError as e:
                done(e)
        self.asker.ask(AskMove(ask_id=self.asker.new_id("restore"), kind="restore", worker=w, blocks=off,
                               session=session), "operator", answered)
