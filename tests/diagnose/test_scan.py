import msgspec

from residency.control.diagnose import ALL_DETECTORS, detect_with, diagnose
from residency.control.diagnose.accounting import Accounting
from residency.control.diagnose.scan import run_pass
from residency.control.fold import fold_all
from residency.control.state import State
from tests.diagnose.ledgers import SECOND, simulated
from tests.diagnose.test_moves import _swing


def test_one_pass_over_all_detectors_finds_what_each_finds_alone(L):
    L.worker(0)
    L.worker(1)
    L.admit()
    _swing(L, 0, L.commit(0, 4), times=3, gap_s=1)
    L.request_move(1, "spill", "device", "host", L.commit(1, 2), deadline_ms=10)
    L.chatter(15)
    at = L.now + 5 * SECOND
    together = diagnose(L.events, at_ns=at).findings
    alone = [f for cls in ALL_DETECTORS for f in detect_with(cls, L.events, at, None)]
    enc = msgspec.json.encode
    assert sorted(map(enc, together)) == sorted(map(enc, alone))
    assert {f.detector for f in together} >= {"pendulum", "overdue_move", "stall"}


def test_now_defaults_to_the_last_event_and_never_to_the_clock(L):
    L.worker(0)
    L.request_move(0, "spill", "device", "host", L.commit(0, 2), deadline_ms=10_000)
    L.chatter(1)
    d = diagnose(L.events)
    assert d.at_ns == L.events[-1].envelope.ts_ns and d.findings == []
    assert d.num_events == len(L.events) and d.at_seq == L.events[-1].seq


def test_the_accounting_agrees_with_the_fold_on_bytes_per_worker_and_tier():
    events = simulated(30_000, seed=5)
    acct = Accounting()
    run_pass(events, [acct])
    state = State()
    fold_all(state, events)
    for w, ws in state.workers.items():
        for tier, account in ws.tiers.items():
            assert acct.used_bytes(w, tier) == account.used_bytes, (w, tier)
    assert set(acct.inflight) == set(state.inflight)
    assert set(acct.stranded) == set(state.stranded)


def test_a_simulated_ledger_is_diagnosed_with_findings_that_carry_proof():
    events = simulated(30_000, seed=5)
    d = diagnose(events)
    assert d.num_events == 30_000
    by_seq = {r.seq for r in events}
    for f in d.findings:
        assert f.seqs and set(f.seqs) <= by_seq, f
        assert f.suggestion and f.title
        assert f.until_ns is None or f.until_ns >= f.onset_ns
    # the simulator writes a lost worker, torn rebinds and strandings: all of them show
    assert {"worker", "torn_rebind", "overdue_move"} <= {f.detector for f in d.findings}
