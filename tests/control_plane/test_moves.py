"""The move lifecycle, the watchdog and recovery's reconciliation: pure functions over a State."""
from __future__ import annotations

import re

import pytest

from residency.control import moves, recovery, watchdog
from residency.control.moves import MoveConfig
from residency.control.policy.proposals import release
from residency.events import catalog as ev
from residency.events.commands import MovesReport, ReleaseBlocks
from residency.events.asks import AskMove

from tests.control_plane.test_policies import BB, Book  # noqa: E402  (shared builder)


def _acked(mid, n=1, freed=None):
    return ev.MoveAcked(move_id=mid, worker=0, bytes_moved=n * BB, bytes_freed_src=n * BB if freed is None else freed,
                        checksum_ok=True, started_ns=1, finished_ns=2)


def test_an_outcome_is_recorded_once_then_duplicates_are_ignored():
    b = Book()
    b.commit([1], 0)
    b.move("m", "evict", "device", "host", [1], 1, ack=False)
    verdict, e = moves.classify(b.state, 0, _acked("m"))
    assert verdict == moves.TERMINAL and e == _acked("m")
    b.add(e)
    assert moves.classify(b.state, 0, _acked("m")) == (moves.DUPLICATE, None)
    assert moves.classify(b.state, 0, _acked("never")) == (moves.UNKNOWN, None)


def test_an_outcome_from_another_worker_is_not_taken():
    b = Book()
    b.commit([1], 0)
    b.move("m", "evict", "device", "host", [1], 1, ack=False)
    assert moves.classify(b.state, 1, _acked("m")) == (moves.WRONG_WORKER, None)


def test_an_ack_after_stranding_is_a_late_ack_and_a_failure_after_stranding_closes_it():
    b = Book()
    b.commit([1, 2], 0)
    b.move("a", "evict", "device", "host", [1], 1, ack=False)
    b.move("f", "evict", "device", "host", [2], 1, ack=False)
    for mid in ("a", "f"):
        b.add(ev.MoveStranded(move_id=mid, worker=0, bytes_at_risk=BB, why="deadline"))
    verdict, e = moves.classify(b.state, 0, _acked("a"))
    assert verdict == moves.LATE and type(e) is ev.MoveLateAcked and e.bytes_moved == BB
    fail = ev.MoveFailed(move_id="f", worker=0, error="x", bytes_moved=None)
    assert moves.classify(b.state, 0, fail) == (
        moves.LATE_FAILURE, ev.MoveLateFailed(move_id="f", worker=0, answer="MoveFailed", reason="x"))


def test_a_release_answered_with_zero_is_recorded_as_zero_freed():
    b = Book()
    b.commit([1, 2], 0)
    ask = release("operator:release", 0, "device", [1, 2], "test")
    req = moves.requested(b.state, ask, "r", 0, MoveConfig())
    assert (req.src, req.dst, req.keep_source, req.reason) == ("device", "device", True, "release:test")
    assert moves.command_for(req) == ReleaseBlocks(release_id="r", tier="device", blocks=[1, 2])
    b.add(req)
    mv = b.state.inflight["r"]
    ack = ev.MoveAcked(move_id="r", worker=0, bytes_moved=0, bytes_freed_src=0, checksum_ok=True,
                       started_ns=1, finished_ns=1)
    out = moves.settle_events(mv, ack, MoveConfig())
    assert out == [ev.CopiesReleased(move_id="r", worker=0, tier="device", blocks=[1, 2], bytes=0)]  # 0 is an accounting
    for e in out:
        b.add(e)
    assert 1 not in b.state.blocks.get(0, {}) and b.state.tier(0, "device").used_bytes == 0
    b.state.check_integrity()


def test_park_and_restore_acks_are_followed_by_session_facts():
    b = Book()
    b.commit([1, 2], 0, session="s")
    b.move("p", "park", "device", "host", [1, 2], 1, ack=False, session="s")
    out = moves.settle_events(b.state.inflight["p"], _acked("p", 2), MoveConfig(page_tokens=16))
    assert [type(e).__name__ for e in out] == ["MoveAcked", "SessionParked"] and out[1].bytes == 2 * BB
    for e in out:
        b.add(e)
    b.move("r", "restore", "host", "device", [1, 2], 2, ack=False, session="s")
    out = moves.settle_events(b.state.inflight["r"], _acked("r", 2), MoveConfig(page_tokens=16))
    assert type(out[1]) is ev.SessionRestored and out[1].restored_tokens == 32
    bad_ack = ev.MoveAcked(move_id="r", worker=0, bytes_moved=2 * BB, bytes_freed_src=2 * BB, checksum_ok=False,
                           started_ns=1, finished_ns=2)
    bad = moves.settle_events(b.state.inflight["r"], bad_ack, MoveConfig())
    assert [type(e).__name__ for e in bad] == ["MoveAcked"]      # not restored: the checksum failed


def test_invalid_asks_are_named_and_record_nothing():
    b = Book()
    b.commit([1, 2], 0, session="s")
    b.move("busy", "spill", "device", "host", [2], 1, keep=True, ack=False)
    cases = [
        (AskMove(ask_id="x", kind="evict", worker=5, blocks=[1]), "not serving"),
        (AskMove(ask_id="x", kind="evict", worker=0, blocks=[9]), "no blocks [9]"),
        (AskMove(ask_id="x", kind="evict", worker=0), "name the blocks or the session"),
        (AskMove(ask_id="x", kind="restore", worker=0, blocks=[1]), "nothing to restore"),
        (AskMove(ask_id="x", kind="evict", worker=0, blocks=[2]), "busy"),
        (AskMove(ask_id="x", kind="evict", worker=0, blocks=[1], src="host", dst="disk"), "no copy on host"),
        (AskMove(ask_id="x", kind="evict", worker=0, blocks=[1], src="host"), "needs two different tiers"),
    ]
    for msg, words in cases:
        with pytest.raises(moves.InvalidAsk, match=re.escape(words)):
            moves.resolve(b.state, msg, "operator")


def test_a_session_ask_with_nothing_on_its_source_is_done_not_invalid():
    b = Book()
    b.commit([1, 2], 0, session="s")
    b.move("p", "park", "device", "host", [1, 2], 1, session="s")
    with pytest.raises(moves.NothingToMove, match=re.escape("no blocks on device (2 blocks: 2 on host)")):
        moves.resolve(b.state, AskMove(ask_id="x", kind="park", worker=0, session="s"), "operator")
    b.move("r", "restore", "host", "device", [1, 2], 2, session="s")
    with pytest.raises(moves.NothingToMove, match=re.escape("already on the device (2 blocks: 2 on device)")):
        moves.resolve(b.state, AskMove(ask_id="x", kind="restore", worker=0, session="s"), "operator")
    with pytest.raises(moves.InvalidAsk) as named:        # named blocks that are not there stay a mistake
        moves.resolve(b.state, AskMove(ask_id="x", kind="restore", worker=0, blocks=[1]), "operator")
    assert type(named.value) is moves.InvalidAsk


def _resolve_ref(state, msg, asker, busy):
    """The plain version of ``moves.resolve`` for named blocks (one list per check, every ask
    validated in full): the single-pass resolve must say exactly what this says."""
    from residency.control.policy.proposals import KIND_DEFAULTS, split_for_destination
    src0, dst0, keep0 = KIND_DEFAULTS[msg.kind]
    src, dst = msg.src or src0, msg.dst or dst0
    keep = keep0 if msg.keep_source is None else msg.keep_source
    wb = state.blocks.get(msg.worker, {})
    blocks = list(dict.fromkeys(msg.blocks))
    missing = [b for b in blocks if b not in wb]
    if missing:
        raise moves.InvalidAsk(f"worker {msg.worker} has no blocks {missing[:16]}")
    on_src = [b for b in blocks if src in wb[b].tiers]
    if len(on_src) != len(blocks):
        raise moves.InvalidAsk(f"blocks {[b for b in blocks if b not in on_src][:16]} have no copy on {src}")
    asks = split_for_destination(state, asker, msg.kind, msg.worker, src, dst, on_src, keep, msg.session, asker)
    if not asks:
        raise moves.InvalidAsk(f"blocks {on_src[:16]} already have a copy on {dst}")
    for a in asks:
        moves.validate(state, a, busy)
    return asks


def test_resolve_in_one_pass_says_what_the_plain_checks_say():
    import random
    rng = random.Random(7)
    tiers = ["device", "host", "disk"]
    for _ in range(300):
        b = Book(device=64, host=64, disk=64)
        ids = rng.sample(range(100), 12)
        for i in ids:       # each block: a random non-empty set of copies
            have = [t for t in tiers if rng.random() < 0.5] or [rng.choice(tiers)]
            b.commit([i], 0, tier=have[0])
            for n, t in enumerate(have[1:]):
                b.move(f"c{i}-{n}", "spill", have[0], t, [i], 0, keep=True)
        busy = {0: set(rng.sample(ids, rng.randint(0, 2)))}
        names = rng.sample(ids + [500], rng.randint(1, 6))
        names += names[:rng.randint(0, 1)]                              # a repeated id now and then
        kind = rng.choice(["spill", "evict", "park", "demote", "promote"])
        msg = AskMove(ask_id="x", kind=kind, worker=0, blocks=names)
        try:
            want = _resolve_ref(b.state, msg, "operator", busy)
        except moves.InvalidAsk as e:
            want = f"InvalidAsk: {e}"
        try:
            got = moves.resolve(b.state, msg, "operator", busy)
        except moves.InvalidAsk as e:
            got = f"InvalidAsk: {e}"
        assert got == want, (kind, names, busy)


def test_a_move_of_blocks_partly_there_copies_the_rest_and_releases_their_source():
    b = Book()
    b.commit([1, 2, 3], 0, session="s")
    b.move("s", "spill", "device", "host", [2], 1, keep=True)          # block 2: on device and host
    asks = moves.resolve(b.state, AskMove(ask_id="x", kind="evict", worker=0, blocks=[1, 2, 3, 1]), "operator")
    assert [(a.src, a.dst, a.blocks, a.keep_source) for a in asks] == [
        ("device", "host", (1, 3), False), ("device", "device", (2,), True)]
    spill = moves.resolve(b.state, AskMove(ask_id="x", kind="spill", worker=0, session="s"), "operator")
    assert [(a.src, a.dst, a.blocks) for a in spill] == [("device", "host", (1, 3))]
    with pytest.raises(moves.InvalidAsk, match="already have a copy on host"):
        moves.resolve(b.state, AskMove(ask_id="x", kind="spill", worker=0, blocks=[2]), "operator")


# ---------------------------------------------------------------------- watchdog
def test_a_passed_deadline_strands_the_move_and_a_silent_release_is_stranded_not_zero():
    b = Book()
    b.commit([1, 2, 3], 0)
    b.add(ev.MoveRequested(move_id="m", kind="evict", worker=0, src="device", dst="host", blocks=[1],
                           bytes_planned=BB, keep_source=False, deadline_ns=100, reason="t"))
    b.add(ev.MoveRequested(move_id="r", kind="evict", worker=0, src="device", dst="device", blocks=[2],
                           bytes_planned=BB, keep_source=True, deadline_ns=100, reason="release:t"))
    b.add(ev.MoveRequested(move_id="u", kind="evict", worker=0, src="device", dst="host", blocks=[3],
                           bytes_planned=BB, keep_source=False, deadline_ns=100, reason="t"))
    b.add(ev.MoveRequested(move_id="later", kind="evict", worker=0, src="host", dst="disk", blocks=[3],
                           bytes_planned=BB, keep_source=False, deadline_ns=10**18, reason="t"))
    assert watchdog.overdue(b.state, 99) == []
    out = {e.move_id: e for e in watchdog.overdue(b.state, 101, undispatched={"u"})}
    assert set(out) == {"m", "r", "u"}
    assert out["m"] == ev.MoveStranded(move_id="m", worker=0, bytes_at_risk=BB, why="deadline")
    assert out["r"].why == "silent_release" and out["r"].bytes_at_risk == BB
    assert type(out["u"]) is ev.MoveAbandoned
    assert watchdog.overdue(b.state, 101, spare_workers={0}) == []


def test_silence_is_first_missed_then_lost():
    missed, lost = watchdog.silence({0: 0, 1: 0, 2: 8_900_000_000}, 10_000_000_000, 1_000_000_000,
                                    5_000_000_000, already_missed={1})
    assert [m.worker for m in missed] == [2] and missed[0].silent_ms == 1100
    assert lost == [(0, 10000), (1, 10000)]


def test_a_lost_worker_names_its_blocks_and_each_of_its_moves():
    b = Book()
    b.commit([1, 2, 3], 0)
    b.move("sent", "evict", "device", "host", [1], 1, ack=False)
    b.move("unsent", "evict", "device", "host", [2], 1, ack=False)
    out = watchdog.loss(b.state, 0, "process exited with code -9", undispatched={"unsent"})
    lost = out[0]
    assert type(lost) is ev.WorkerLost and lost.blocks_lost == [1, 2, 3] and lost.bytes_lost == 3 * BB
    assert {(type(e).__name__, e.move_id) for e in out[1:]} == {("MoveStranded", "sent"), ("MoveAbandoned", "unsent")}
    assert [e for e in out if type(e) is ev.MoveStranded][0].why == "worker_lost"
    for e in out:
        b.add(e)
    b.state.check_integrity()
    assert b.state.stranded_bytes_total() == 3 * BB       # block 1 once: under the loss, not again under its move


# ---------------------------------------------------------------------- recovery
def test_a_report_settles_what_the_worker_did_and_abandons_what_it_never_saw():
    b = Book()
    b.commit([1, 2, 3, 4], 0)
    for mid, blk in (("done", 1), ("never", 2), ("running", 3), ("was-stranded", 4)):
        b.move(mid, "evict", "device", "host", [blk], 1, ack=False)
    b.add(ev.MoveStranded(move_id="was-stranded", worker=0, bytes_at_risk=BB, why="deadline"))
    book = moves.MoveBook()
    asked = recovery.to_query(b.state, 0, book)
    assert sorted(asked) == ["done", "never", "running", "was-stranded"]
    report = MovesReport(worker=0, outcomes=[_acked("done"), _acked("was-stranded")], unknown=["never"])
    out = {e.move_id: (v, type(e).__name__) for v, e in recovery.reconcile(b.state, 0, report, asked)}
    assert out == {"done": (moves.TERMINAL, "MoveAcked"), "never": (moves.TERMINAL, "MoveAbandoned"),
                   "was-stranded": (moves.LATE, "MoveLateAcked")}       # "running" stays in flight


def test_a_stranded_move_its_worker_rejected_is_closed_and_its_bytes_no_longer_at_risk():
    b = Book()
    b.commit([1, 2, 3], 0)
    for mid, blk in (("rejected", 1), ("unseen", 2), ("acked", 3)):
        b.move(mid, "evict", "device", "host", [blk], 1, ack=False)
        b.add(ev.MoveStranded(move_id=mid, worker=0, bytes_at_risk=BB, why="deadline"))
    asked = recovery.to_query(b.state, 0, moves.MoveBook())
    rejected = ev.MoveRejected(move_id="rejected", worker=0, reason="deadline: passed", asked_bytes=BB)
    report = MovesReport(worker=0, outcomes=[rejected, _acked("acked")], unknown=["unseen"])
    settled = recovery.reconcile(b.state, 0, report, asked)
    # "never received" is not recorded: the worker answering may be a new incarnation, which cannot
    # speak for the command its lost predecessor had (the control process only stops holding room for it)
    assert {e.move_id: (v, type(e).__name__, getattr(e, "answer", None)) for v, e in settled} == {
        "rejected": (moves.LATE_FAILURE, "MoveLateFailed", "MoveRejected"),
        "acked": (moves.LATE, "MoveLateAcked", None)}
    for _, e in settled:
        b.add(e)
    b.state.check_integrity()
    assert list(b.state.stranded) == ["unseen"] and b.state.stranded_bytes_total() == BB
    wb = b.state.blocks[0]
    assert (wb[1].tiers, wb[2].tiers, wb[3].tiers) == (["device"], ["device"], ["host"])   # only the ack moved a copy


def test_join_causation_round_trips_and_epochs_only_grow():
    assert recovery.parse_join_causation(recovery.join_causation(3, 17)) == (3, 17)
    assert recovery.parse_join_causation("operator:park") is None
    assert recovery.next_epoch(100, 50) == 101 and recovery.next_epoch(100, 500) == 500


def _plan_restore_ref(state, blocks, src=None):
    """The plain version of ``plan_restore``: each block from the fastest tier holding it (host
    before disk), none already on the device, one move per source in order of first use."""
    wb = state.blocks.get(0, {})
    by_src: dict[str, list[int]] = {}
    for b in blocks:
        tiers = wb[b].tiers
        if "device" in tiers:
            continue
        source = src if src is not None else next((t for t in ("host", "disk") if t in tiers), None)
        if source is None or source not in tiers:
            continue
        by_src.setdefault(source, []).append(b)
    return [(s, tuple(bl)) for s, bl in by_src.items()]


def test_a_restore_takes_each_block_from_its_fastest_copy_one_move_per_source_in_order_of_first_use():
    import random
    from residency.control.policy.restore import plan_restore
    rng = random.Random(11)
    tiers = ["device", "host", "disk"]
    for _ in range(300):
        b = Book(device=64, host=64, disk=64)
        ids = rng.sample(range(100), 12)
        for i in ids:
            have = [t for t in tiers if rng.random() < 0.5] or [rng.choice(tiers)]
            b.commit([i], 0, tier=have[0])
            for n, t in enumerate(have[1:]):
                b.move(f"c{i}-{n}", "spill", have[0], t, [i], 0, keep=True)
        names = rng.sample(ids, rng.randint(1, 8))
        src = rng.choice([None, None, "host", "disk", "device"])
        got = [(a.src, a.blocks) for a in plan_restore(b.state, "operator", 0, names, None, False, src)]
        assert got == _plan_restore_ref(b.state, names, src), (names, src)


def test_an_ask_naming_unknown_blocks_names_them_whatever_its_kind():
    b = Book()
    b.commit([1, 2], 0)
    for kind, extra in (("restore", {}), ("evict", {}), ("spill", {}), ("evict", {"src": "device", "dst": "device"})):
        with pytest.raises(moves.InvalidAsk, match=re.escape("worker 0 has no blocks [7, 9]")):
            moves.resolve(b.state, AskMove(ask_id="x", kind=kind, worker=0, blocks=[1, 7, 9, 7], **extra), "operator")
