"""The fold: invariants, determinism, snapshots, and what it does with impossible events."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from residency.control.fold import fold, fold_all, fold_run
from residency.control.simulate import Simulator
from residency.control.state import IntegrityError, State, check_integrity, decode_state, encode_state, index_copies, state_hash
from residency.events import catalog as ev
from residency.events.envelope import Envelope, Recorded

MiB = 1 << 20


def _records(pairs):
    return [Recorded(env, e) for env, e in pairs]


class Ledger:
    """A tiny in-memory event list with seqs, for hand-built stories."""

    def __init__(self):
        self.items: list[Recorded] = []

    def add(self, event, ts=None):
        seq = len(self.items) + 1
        env = Envelope(producer="t", epoch=1, producer_seq=seq, ts_ns=ts or seq * 1000, seq=seq)
        self.items.append(Recorded(env, event))
        return seq

    def state(self) -> State:
        return fold_all(State(), self.items)


def _joined(lg: Ledger, block_bytes=MiB, device=8, host=16):
    lg.add(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": device * block_bytes, "host": host * block_bytes,
                                                           "disk": 64 * block_bytes}, block_bytes=block_bytes))


def _spill(lg, mid, blocks, keep, outcome="ack", src="device", dst="host", bb=MiB):
    lg.add(ev.MoveRequested(move_id=mid, kind="spill" if keep else "evict", worker=0, src=src, dst=dst,
                            blocks=blocks, bytes_planned=len(blocks) * bb, keep_source=keep,
                            deadline_ns=10**18, reason="test"))
    if outcome == "ack":
        lg.add(ev.MoveAcked(move_id=mid, worker=0, bytes_moved=len(blocks) * bb,
                            bytes_freed_src=0 if keep else len(blocks) * bb, checksum_ok=True,
                            started_ns=1, finished_ns=2))


def test_bytes_appear_on_the_destination_only_once_acked():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session="s", tier="device", blocks=[1, 2, 3], keys=["a", "b", "c"],
                              bytes=3 * MiB))
    _spill(lg, "m1", [1, 2], keep=False, outcome=None)
    s = lg.state()
    assert s.tier(0, "host").used_bytes == 0
    assert s.tier(0, "host").inflight_in_bytes == 2 * MiB
    assert s.tier(0, "device").used_bytes == 3 * MiB
    lg.add(ev.MoveAcked(move_id="m1", worker=0, bytes_moved=2 * MiB, bytes_freed_src=2 * MiB, checksum_ok=True,
                        started_ns=1, finished_ns=2))
    s = lg.state()
    assert (s.tier(0, "host").used_bytes, s.tier(0, "host").inflight_in_bytes) == (2 * MiB, 0)
    assert s.tier(0, "device").used_bytes == MiB
    assert s.tier(0, "device").reclaimed_bytes == 2 * MiB
    check_integrity(s)


def test_reclaimed_bytes_come_from_the_ack_not_the_plan():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[7], keys=[""], bytes=MiB))
    lg.add(ev.MoveRequested(move_id="m", kind="evict", worker=0, src="device", dst="host", blocks=[7],
                            bytes_planned=MiB, keep_source=False, deadline_ns=1, reason="t"))
    lg.add(ev.MoveAcked(move_id="m", worker=0, bytes_moved=MiB, bytes_freed_src=12345, checksum_ok=True,
                        started_ns=1, finished_ns=2))
    assert lg.state().tier(0, "device").reclaimed_bytes == 12345


def test_a_second_terminal_event_is_an_anomaly_named_by_seq():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[1], keys=[""], bytes=MiB))
    _spill(lg, "m1", [1], keep=True)
    seq = lg.add(ev.MoveFailed(move_id="m1", worker=0, error="late failure"))
    with pytest.raises(IntegrityError, match=f"seq {seq}: move m1 got MoveFailed after its terminal MoveAcked"):
        check_integrity(lg.state())


def test_a_late_ack_only_follows_a_stranding_and_reaccounts_it():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[1, 2], keys=["", ""], bytes=2 * MiB))
    _spill(lg, "m1", [1, 2], keep=False, outcome=None)
    lg.add(ev.MoveStranded(move_id="m1", worker=0, bytes_at_risk=2 * MiB, why="deadline"))
    s = lg.state()
    assert s.tier(0, "device").stranded_bytes == 2 * MiB and "m1" in s.stranded
    lg.add(ev.MoveLateAcked(move_id="m1", worker=0, bytes_moved=2 * MiB, bytes_freed_src=2 * MiB, checksum_ok=True,
                            started_ns=1, finished_ns=2))
    s = lg.state()
    assert s.tier(0, "device").stranded_bytes == 0 and not s.stranded
    assert s.tier(0, "host").used_bytes == 2 * MiB and s.tier(0, "device").used_bytes == 0
    check_integrity(s)
    seq = lg.add(ev.MoveLateAcked(move_id="m1", worker=0, bytes_moved=1, bytes_freed_src=0, checksum_ok=True,
                                  started_ns=1, finished_ns=2))
    with pytest.raises(IntegrityError, match=f"seq {seq}: MoveLateAcked for move m1 that is not stranded"):
        check_integrity(lg.state())


def test_freeing_a_copy_that_is_not_there_is_named():
    lg = Ledger()
    _joined(lg)
    seq = lg.add(ev.BlocksFreed(worker=0, tier="host", blocks=[99], bytes=MiB, reason="finished"))
    with pytest.raises(IntegrityError, match=f"seq {seq}: block 99 has no copy on host"):
        check_integrity(lg.state())


def test_used_over_capacity_is_reported_with_numbers():
    lg = Ledger()
    _joined(lg, device=2)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[1, 2, 3], keys=["", "", ""],
                              bytes=3 * MiB))
    with pytest.raises(IntegrityError, match=f"used {3 * MiB} > capacity {2 * MiB}"):
        check_integrity(lg.state())


def test_a_lost_worker_takes_its_copies_and_names_the_bytes():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[1, 2], keys=["", ""], bytes=2 * MiB))
    lg.add(ev.WorkerLost(worker=0, reason="kill -9", blocks_lost=[1, 2], bytes_lost=2 * MiB))
    s = lg.state()
    assert s.tier(0, "device").used_bytes == 0 and not s.blocks.get(0)
    assert s.stranded_bytes_total() == 2 * MiB
    check_integrity(s)


def test_a_worker_lost_keeps_the_disk_copies_its_next_incarnation_found_and_nothing_else():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session="s", tier="device", blocks=[1, 2, 3], keys=["k1", "k2", ""],
                              bytes=3 * MiB))
    _spill(lg, "m1", [1, 2], keep=True, dst="disk")              # 1 and 2: on device and disk; 3 on device
    lg.add(ev.WorkerLost(worker=0, reason="stopped with the server", blocks_lost=[2, 3], bytes_lost=2 * MiB,
                         kept_on_disk=[1], bytes_kept=MiB))
    s = lg.state()
    assert {b: st.tiers for b, st in s.blocks[0].items()} == {1: ["disk"]} and s.blocks[0][1].session == "s"
    assert [s.tier(0, t).used_bytes for t in ("device", "host", "disk")] == [0, 0, MiB]
    assert s.stranded_bytes_total() == 2 * MiB and not s.anomalies
    check_integrity(s)
    live = index_copies(lg.state())           # the copy index the live control keeps agrees
    assert live.copies[0]["disk"] == {1}
    lg.add(ev.WorkerJoined(worker=0, device="cpu", tiers={"device": 8 * MiB, "host": 16 * MiB, "disk": 64 * MiB},
                           block_bytes=MiB))
    lg.add(ev.WorkerLost(worker=0, reason="again", kept_on_disk=[1, 3]))     # 3 never had a disk copy
    s = lg.state()
    assert list(s.blocks[0]) == [1] and any("keeps block 3" in what for _, what in s.anomalies)


def test_a_byte_stranded_on_a_worker_that_is_then_lost_is_counted_once():
    """Both orders a ledger records them in: a move stranded by its deadline before the loss, and
    one in flight at the loss (stranded right after it, why=worker_lost). The loss's bytes_lost
    names every block that was on the worker; neither stranding adds to it."""
    rng = random.Random()
    bb = rng.randrange(1, 64) * 4096
    lg = Ledger()
    _joined(lg, block_bytes=bb)
    n1, n2, n3 = rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 5)
    b1, b2, b3 = list(range(1, 1 + n1)), list(range(10, 10 + n2)), list(range(20, 20 + n3))
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=b1 + b2 + b3, keys=[""] * (n1 + n2 + n3),
                              bytes=(n1 + n2 + n3) * bb))
    _spill(lg, "m1", b1, keep=False, outcome=None, bb=bb)
    lg.add(ev.MoveStranded(move_id="m1", worker=0, bytes_at_risk=n1 * bb, why="deadline"))
    _spill(lg, "m2", b2, keep=False, outcome=None, bb=bb)
    assert lg.state().stranded_bytes_total() == n1 * bb
    everything = sorted(b1 + b2 + b3)
    lg.add(ev.WorkerLost(worker=0, reason="kill -9", blocks_lost=everything, bytes_lost=len(everything) * bb))
    lg.add(ev.MoveStranded(move_id="m2", worker=0, bytes_at_risk=n2 * bb, why="worker_lost"))
    s = lg.state()
    assert s.stranded_bytes_total() == (n1 + n2 + n3) * bb
    assert s.tier(0, "device").stranded_bytes == 0 and set(s.stranded) == {"m1", "m2"}
    assert {mv.status for mv in s.stranded.values()} == {"lost"}
    check_integrity(s)
    # a late ack of a move of the lost incarnation changes nothing: its bytes were counted by the loss
    lg.add(ev.MoveLateAcked(move_id="m1", worker=0, bytes_moved=n1 * bb, bytes_freed_src=n1 * bb, checksum_ok=True,
                            started_ns=1, finished_ns=2))
    s = lg.state()
    assert s.stranded_bytes_total() == (n1 + n2 + n3) * bb and not s.blocks.get(0)
    check_integrity(s)


def test_the_stranded_account_must_match_the_stranded_moves():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.BlocksCommitted(worker=0, session=None, tier="device", blocks=[1], keys=[""], bytes=MiB))
    _spill(lg, "m1", [1], keep=False, outcome=None)
    lg.add(ev.MoveStranded(move_id="m1", worker=0, bytes_at_risk=MiB, why="deadline"))
    s = lg.state()
    check_integrity(s)
    s.tier(0, "device").stranded_bytes += 3
    with pytest.raises(IntegrityError, match=f"worker 0 device: stranded_bytes {MiB + 3} != bytes at risk"):
        check_integrity(s)


def test_a_rebind_committed_with_a_reader_behind_is_an_anomaly():
    lg = Ledger()
    _joined(lg)
    lg.add(ev.RebindRequested(rebind_id="r", worker=0, pool="device", from_gen=0, to_gen=1, readers=["a", "b"]))
    lg.add(ev.ReaderStamped(rebind_id="r", reader="a", gen=1))
    seq = lg.add(ev.RebindCommitted(rebind_id="r"))
    with pytest.raises(IntegrityError, match=f"seq {seq}: rebind r committed while readers \\['b'\\]"):
        check_integrity(lg.state())


def test_the_hash_sees_content_and_ignores_position():
    sim = Simulator(seed=random.randrange(1 << 30))
    recs = _records(sim.events(3000))
    a = fold_all(State(), recs)
    b = fold_all(State(), recs)
    assert state_hash(a) == state_hash(b)
    b.workers[0].tiers["device"].reclaimed_bytes += 1
    assert state_hash(a) != state_hash(b)
    c = fold_all(State(), recs)
    c.last_seq += 5
    assert state_hash(a) == state_hash(c)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(50, 4000), cut=st.floats(0, 1))
def test_replay_from_a_snapshot_equals_replay_from_zero_equals_live(seed, n, cut):
    sim = Simulator(seed=seed, checkpoint_every=97)
    recs = _records(sim.events(n))
    live = sim.state
    from_zero = fold_all(State(), recs)
    k = int(cut * len(recs))
    head = fold_all(State(), recs[:k])
    resumed = fold_all(decode_state(encode_state(head)), recs[k:])
    assert state_hash(from_zero) == state_hash(live) == state_hash(resumed)
    assert from_zero.last_seq == resumed.last_seq == n
    check_integrity(from_zero)
    # every checkpoint the simulator wrote matches a replay to its through_seq
    for seq, through, h in from_zero.checkpoints:
        assert state_hash(fold_all(State(), recs[:through])) == h


def test_single_fold_and_fold_all_agree():
    recs = _records(Simulator(seed=random.randrange(1 << 30)).events(2000))
    one = State()
    for r in recs:
        one = fold(one, r)
    assert state_hash(one) == state_hash(fold_all(State(), recs))


def test_fold_run_over_a_gapless_run_equals_fold_all():
    """fold_run (replay's loop: seqs implied by the first one) leaves exactly what fold_all leaves,
    cut into runs anywhere, impossible events (anomalies, named by seq) included."""
    rng = random.Random(random.randrange(1 << 30))
    recs = _records(Simulator(seed=rng.randrange(1 << 30)).events(3000))
    # an impossible event in the middle: its anomaly must carry the same seq both ways
    k = rng.randrange(1, len(recs))
    env = Envelope(producer="t", epoch=1, producer_seq=1, ts_ns=recs[k - 1].envelope.ts_ns, seq=k)
    recs = recs[:k - 1] + [Recorded(env, ev.MoveAcked(move_id="never", worker=0, bytes_moved=1, bytes_freed_src=1,
                                                      checksum_ok=True, started_ns=1, finished_ns=2))] + recs[k:]
    want = fold_all(State(), recs)
    got, pos = State(), 0
    while pos < len(recs):
        run = recs[pos:pos + rng.randint(1, 700)]
        fold_run(got, run[0].envelope.seq, [r.event for r in run], run[-1].envelope.ts_ns)
        pos += len(run)
    assert state_hash(got) == state_hash(want)
    assert (got.last_seq, got.last_ts_ns, got.anomalies, got.checkpoints) == \
        (want.last_seq, want.last_ts_ns, want.anomalies, want.checkpoints)
    assert (k, "MoveAcked for move never that was never requested") in got.anomalies


# ---------------------------------------------------------------------- fast paths vs their references
def _apply_arrival_ref(s: State, mv, bytes_freed_src: int, checksum_ok: bool, seq: int) -> None:
    """control.fold_moves._apply_arrival before its sole-copy fast path: every block the general way."""
    from residency.control.fold_base import anomaly as _anomaly

    ws = s.workers.get(mv.worker)
    if ws is None:
        return
    get = s.blocks.get(mv.worker, {}).get
    src, dst, drop, to_device = mv.src, mv.dst, not mv.keep_source, mv.dst == "device"
    added = dropped = 0
    for bid in mv.blocks:
        b = get(bid)
        if b is None:
            _anomaly(s, seq, f"move {mv.move_id} acked for block {bid} that no longer exists")
            continue
        tiers = b.tiers
        if dst not in tiers:
            tiers.append(dst)
            added += 1
        if to_device:
            b.device_verified = checksum_ok
        if drop and src in tiers:
            tiers.remove(src)
            dropped += 1
    accounts = ws.tiers
    accounts[dst].used_bytes += added * ws.block_bytes
    accounts[src].used_bytes -= dropped * ws.block_bytes
    accounts[src].reclaimed_bytes += bytes_freed_src


def _blocks_committed_ref(s: State, e: ev.BlocksCommitted, seq: int) -> None:
    """control.fold._blocks_committed before new blocks were made with their copy in place."""
    from residency.control.fold_base import anomaly as _anomaly
    from residency.control.state import BlockState, SessionState

    ws = s.workers.get(e.worker)
    if ws is None:
        _anomaly(s, seq, f"BlocksCommitted names unknown worker {e.worker}")
        return
    keys = e.keys if len(e.keys) == len(e.blocks) else [""] * len(e.blocks)
    blocks = s.blocks.setdefault(e.worker, {})
    added = 0
    for bid, key in zip(e.blocks, keys):
        b = blocks.get(bid)
        if b is None:
            b = blocks[bid] = BlockState(session=e.session, key=key, tiers=[])
        if e.tier in b.tiers:
            _anomaly(s, seq, f"block {bid} already has a copy on {e.tier} of worker {e.worker}")
            continue
        b.tiers.append(e.tier)
        added += 1
    ws.tiers[e.tier].used_bytes += added * ws.block_bytes
    if e.session is not None:
        sess = s.sessions.get(e.session)
        if sess is None:
            sess = s.sessions[e.session] = SessionState(session=e.session)
        sess.worker = e.worker


_TIER_LISTS = st.lists(st.sampled_from(["device", "host", "disk"]), max_size=3, unique=True)


@st.composite
def _worker_with_blocks(draw):
    """A state with worker 0 holding random blocks: any tiers in any order (none at all too), any
    verification; plus block ids that are not there (up to 40, so a few are missing)."""
    from residency.control.state import BlockState, new_worker

    s = State()
    s.workers[0] = new_worker(0, "cpu", {"device": 1 << 40, "host": 1 << 40, "disk": 1 << 40}, draw(st.integers(1, 4096)))
    ids = draw(st.lists(st.integers(0, 40), max_size=30, unique=True))
    s.blocks[0] = {bid: BlockState(session=draw(st.sampled_from([None, "a"])), key="",
                                   tiers=draw(_TIER_LISTS), device_verified=draw(st.booleans())) for bid in ids}
    for t, acc in s.workers[0].tiers.items():      # any starting accounts: both ways must move them alike
        acc.used_bytes = draw(st.integers(0, 1 << 30))
    return s


@settings(max_examples=400, deadline=None)
@given(state=_worker_with_blocks(), data=st.data())
def test_an_ack_folds_the_same_with_and_without_the_sole_copy_fast_path(state, data):
    """Every block kind at once: sole copies on the source (the fast path), copies on other tiers too,
    copies already on the destination, no copy anywhere, missing blocks, a block named twice, a
    kept source, a move naming one tier twice, a failed checksum toward the device."""
    from residency.control.fold_moves import _apply_arrival
    from residency.control.state import MoveState

    known = list(state.blocks[0]) or [0]
    blocks = data.draw(st.lists(st.one_of(st.sampled_from(known), st.integers(0, 45)), max_size=40))
    mv = MoveState("m", "evict", 0, data.draw(st.sampled_from(["device", "host", "disk"])),
                   data.draw(st.sampled_from(["device", "host", "disk"])), blocks, 0, data.draw(st.booleans()),
                   1, None, 1)
    freed, ok = data.draw(st.integers(0, 1 << 30)), data.draw(st.booleans())
    want, got = decode_state(encode_state(state)), index_copies(decode_state(encode_state(state)))
    _apply_arrival_ref(want, mv, freed, ok, 7)
    _apply_arrival(got, mv, freed, ok, 7)
    assert encode_state(got) == encode_state(want)
    assert _copies(got.copies) == _copies(index_copies(decode_state(encode_state(got))).copies)   # kept == rebuilt


@settings(max_examples=300, deadline=None)
@given(state=_worker_with_blocks(), data=st.data())
def test_blocks_committed_folds_the_same_as_its_reference(state, data):
    """New blocks, blocks already there (with or without a copy on the tier), a block named twice."""
    from residency.control.fold import _blocks_committed

    blocks = data.draw(st.lists(st.integers(0, 45), max_size=40))
    keys = data.draw(st.one_of(st.just([]), st.lists(st.text(max_size=3), min_size=len(blocks), max_size=len(blocks))))
    e = ev.BlocksCommitted(worker=data.draw(st.sampled_from([0, 0, 1])), session=data.draw(st.sampled_from([None, "b"])),
                           tier=data.draw(st.sampled_from(["device", "host", "disk"])), blocks=blocks, keys=keys,
                           bytes=len(blocks))
    want, got = decode_state(encode_state(state)), index_copies(decode_state(encode_state(state)))
    _blocks_committed_ref(want, e, 7)
    _blocks_committed(got, e, 7)
    assert encode_state(got) == encode_state(want)
    assert _copies(got.copies) == _copies(index_copies(decode_state(encode_state(got))).copies)


def _copies(copies: dict) -> dict:
    """The copy index without its empty sets (a rebuilt index makes none)."""
    return {w: {t: ids for t, ids in per.items() if ids} for w, per in copies.items() if any(per.values())}
