"""A release answered the old way (an ack that moved nothing, then BlocksFreed(reason="release"))
and the new way (CopiesReleased) mean the same: the same replayed state, the same audit, the same
diagnosis and report. Ledgers written before CopiesReleased keep their rows and their answers."""
from __future__ import annotations

import msgspec
import pytest

from residency.control.cli.audit_cmd import query
from residency.control.diagnose import diagnose
from residency.control.fold import fold_decoded
from residency.control.replay import replay
from residency.control.report import collect
from residency.control.state import State, state_hash
from residency.events import Envelope
from residency.events import catalog as ev
from residency.ledger import LedgerStore

BB = 4096
T0 = 10**18
S = 10**9


def _release(mid: str, tier: str, blocks: list[int], session: str | None = "s") -> ev.MoveRequested:
    return ev.MoveRequested(move_id=mid, kind="evict", worker=0, src=tier, dst=tier, blocks=blocks,
                            bytes_planned=len(blocks) * BB, keep_source=True, deadline_ns=T0 + 60 * S,
                            reason="release:finished", session=session)


def _answer(form: str, mid: str, tier: str, blocks: list[int], freed: int, late: bool) -> list[ev.Event]:
    if form == "new":
        return [ev.CopiesReleased(move_id=mid, worker=0, tier=tier, blocks=blocks, bytes=freed)]
    fields = dict(move_id=mid, worker=0, bytes_moved=0, bytes_freed_src=0, checksum_ok=True, started_ns=1, finished_ns=1)
    ack = ev.MoveLateAcked(**fields) if late else ev.MoveAcked(**fields)
    return [ack, ev.BlocksFreed(worker=0, tier=tier, blocks=blocks, bytes=freed, reason="release")]


def _steps(form: str) -> list[list[ev.Event]]:
    """One list of events per instant: what a control process recorded at that time."""
    return [
        [ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 64 * BB, "host": 64 * BB, "disk": 64 * BB},
                         block_bytes=BB)],
        [ev.BlocksCommitted(worker=0, session="s", tier="device", blocks=list(range(1, 9)), keys=[""] * 8,
                            bytes=8 * BB)],
        [ev.RequestAdmitted(request_id="q", session="s", prompt_tokens=5)],
        [ev.MoveRequested(move_id="sp", kind="spill", worker=0, src="device", dst="host", blocks=[1, 2, 3, 4],
                          bytes_planned=4 * BB, keep_source=True, deadline_ns=T0 + 60 * S, reason="policy:pressure",
                          session="s")],
        [ev.MoveAcked(move_id="sp", worker=0, bytes_moved=4 * BB, bytes_freed_src=0, checksum_ok=True,
                      started_ns=1, finished_ns=2)],
        # a release answered on time with what the worker measured
        [_release("r1", "device", [1, 2, 3])],
        _answer(form, "r1", "device", [1, 2, 3], 3 * BB, late=False),
        # a release answered with 0 measured: an accounting, recorded as 0
        [_release("r2", "device", [4], session=None)],
        _answer(form, "r2", "device", [4], 0, late=False),
        # a release stranded (its worker was silent), answered after all
        [_release("r3", "host", [1, 2])],
        [ev.MoveStranded(move_id="r3", worker=0, bytes_at_risk=2 * BB, why="silent_release")],
        _answer(form, "r3", "host", [1, 2], 2 * BB, late=True),
        # a release stranded for good
        [_release("r4", "host", [3])],
        [ev.MoveStranded(move_id="r4", worker=0, bytes_at_risk=BB, why="silent_release")],
        [ev.BlocksFreed(worker=0, tier="device", blocks=[5], bytes=BB, reason="finished")],
        [ev.RequestFinished(request_id="q", reason="stop", completion_tokens=3)],
    ]


def _write(store, form: str, epoch: int = 1, prefix: str = "") -> None:
    """Append the steps; ``prefix`` goes before every move id (two ledgers in one database)."""
    items, n = [], 0
    for i, step in enumerate(_steps(form)):
        for e in step:
            n += 1
            if prefix and hasattr(e, "move_id"):
                e = msgspec.structs.replace(e, move_id=prefix + e.move_id)
            items.append((Envelope(producer="control", epoch=epoch, producer_seq=n, ts_ns=T0 + i * S), e))
    store.append(items)


@pytest.fixture
def ledgers(tmp_path):
    stores = {}
    for form in ("old", "new"):
        stores[form] = LedgerStore.open(f"sqlite:///{tmp_path / form}.db", create=True)
        _write(stores[form], form)
    yield stores
    for s in stores.values():
        s.close()


def test_the_new_form_is_one_row_per_answer(ledgers):
    types = [type(r.event).__name__ for r in ledgers["new"].read()]
    assert types.count("CopiesReleased") == 3 and "MoveLateAcked" not in types
    assert [type(r.event).__name__ for r in ledgers["old"].read()].count("CopiesReleased") == 0


def _renumbered(state: State) -> State:
    """The state with the seqs it names (of a move's request) set aside: one row per answer instead
    of two numbers the later rows differently, and that is the only difference allowed."""
    for mv in [*state.inflight.values(), *state.stranded.values()]:
        mv.requested_seq = 0
    return state


def test_a_ledger_written_the_old_way_replays_to_the_state_of_one_written_the_new_way(ledgers):
    old, _ = replay(ledgers["old"])
    new, _ = replay(ledgers["new"])
    assert state_hash(_renumbered(old)) == state_hash(_renumbered(new))
    assert old.anomalies == new.anomalies == []
    new.check_integrity()
    assert new.outcomes == {"sp": "MoveAcked", "r1": "MoveAcked", "r2": "MoveAcked", "r3": "MoveLateAcked",
                            "r4": "MoveStranded"}
    device, host = new.tier(0, "device"), new.tier(0, "host")
    assert device.reclaimed_bytes == 3 * BB + 0 + BB and host.reclaimed_bytes == 2 * BB
    assert host.stranded_bytes == BB and list(new.stranded) == ["r4"]
    assert sorted(new.blocks[0]) == [3, 4, 6, 7, 8]  # 1, 2 released on both tiers, 5 freed; 3, 4 kept on host


def test_the_fold_of_copies_released_names_what_it_could_not_free():
    s = State()
    events = [*_steps("new")[0], *_steps("new")[1], _release("r", "device", [1, 99]),
              ev.CopiesReleased(move_id="r", worker=0, tier="device", blocks=[1, 99], bytes=BB)]
    fold_decoded(s, [(i + 1, T0, e) for i, e in enumerate(events)])
    assert (4, "block 99 has no copy on device of worker 0 to free") in s.anomalies
    assert 1 not in s.blocks[0] and s.outcomes == {"r": "MoveAcked"} and not s.inflight


@pytest.mark.parametrize("by", ["tier", "worker", "session", "kind"])
def test_the_audit_reclaims_the_same_bytes_whichever_form_recorded_the_releases(ledgers, by):
    totals = {}
    for form, store in ledgers.items():
        groups, _ = query(store, "reclaimed", by, None, None, 100)
        totals[form] = {g: t for g, t, _ in groups if t}        # the old form adds 0-byte ack rows
    assert totals["old"] == totals["new"] and sum(totals["new"].values()) == 6 * BB
    if by == "kind":
        assert totals["new"] == {"release": 5 * BB, "finished": BB}


def test_the_audit_of_stranded_bytes_counts_a_release_answered_late_as_resolved(ledgers):
    for store in ledgers.values():
        groups, rows = query(store, "stranded", "kind", None, None, 100)
        assert [(g, t) for g, t, _ in groups] == [("silent_release", BB)]
        assert [r["move_id"] for r in rows] == ["r4"]


def test_diagnose_and_report_give_the_same_answers_for_both_forms(ledgers):
    def answers(store):
        events = list(store.read())
        d = diagnose(events)
        _, col = collect(events)
        findings = [(f.detector, f.severity, f.title, f.subject) for f in d.findings]
        outcomes = {k: len(v.ts) for k, v in col.outcomes.items()}
        return findings, col.reclaimed, col.stranded_by_why, outcomes, col.bytes_moved, col.num_moves

    old, new = answers(ledgers["old"]), answers(ledgers["new"])
    assert old == new
    assert new[1] == {("device", "release"): 3 * BB, ("host", "release"): 2 * BB, ("device", "finished"): BB}
    assert new[2] == {"silent_release": BB}
