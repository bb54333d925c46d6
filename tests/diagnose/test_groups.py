from residency.events import catalog as ev
from residency.control.diagnose import DiagnoseParams, detect_group_divergence
MS = 1_000_000


def run_steps(L, steps, workers=(0, 1), diverge=(), gap_ms=50.0):
    """Each step reported by every worker; on steps in ``diverge`` the last worker reports another digest."""
    recs = {}
    for s in steps:
        digest = f"{L.rng.getrandbits(64):016x}"
        for w in workers:
            d = f"{L.rng.getrandbits(64):016x}" if (s in diverge and w == workers[-1]) else digest
            recs[(s, w)] = L.step(w, s, digest=d, dt_ms=gap_ms / len(workers))
    return recs


def test_ranks_whose_digests_differ_are_reported_with_onset_duration_and_recovery_edge(L):
    L.worker(0)
    L.worker(1)
    recs = run_steps(L, range(1, 31), diverge=set(range(11, 21)))
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.onset_ns == recs[(11, 0)].envelope.ts_ns
    assert f.until_ns == recs[(21, 1)].envelope.ts_ns
    assert f.detail["first_step"] == 11 and f.detail["last_diverged_step"] == 20
    assert f.detail["num_steps_diverged"] == 10 and f.detail["recovered_at_step"] == 21
    assert {recs[(11, 0)].seq, recs[(11, 1)].seq, recs[(21, 1)].seq} <= set(f.seqs)


def test_a_divergence_that_persists_is_reported_as_ongoing_with_its_duration_so_far(L):
    L.worker(0)
    L.worker(1)
    L.worker(2)
    recs = run_steps(L, range(1, 41), workers=(0, 1, 2), diverge=set(range(8, 41)))
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.severity == "critical" and f.until_ns is None
    assert f.onset_ns == recs[(8, 0)].envelope.ts_ns
    assert f.detail["last_diverged_step"] == 40 and f.detail["num_steps_diverged"] == 33
    # judged at any point while it persists, it is there again, longer
    cut = [r for r in L.events if r.seq <= recs[(25, 2)].seq]
    [mid] = detect_group_divergence(cut, at_ns=cut[-1].envelope.ts_ns)
    assert mid.until_ns is None and mid.detail["last_diverged_step"] == 25


def test_a_straggler_step_is_judged_once_the_group_moves_on(L):
    L.worker(0)
    L.worker(1)
    digest = "d" * 16
    L.step(0, 1, digest=digest)
    L.step(1, 1, digest=digest)
    L.step(0, 2, digest="a" * 16)      # rank 1 never reports step 2
    run_steps(L, range(3, 10))
    assert detect_group_divergence(L.events, at_ns=L.now) == []


def test_a_group_diverged_row_opens_an_episode_and_agreement_closes_it(L):
    L.worker(0)
    L.worker(1)
    run_steps(L, range(1, 5))
    row = L.add(ev.GroupDiverged(group="tp0", step=5, digests_by_rank={"0": "aa", "1": "bb"}))
    recs = run_steps(L, range(6, 9))
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.subject == "group tp0" and row.seq in f.seqs
    assert f.until_ns == recs[(6, 1)].envelope.ts_ns


def test_independent_workers_with_their_own_batches_are_not_a_group(L):
    L.worker(0)
    L.worker(1)
    for s in range(1, 50):
        L.step(0, s)
        L.step(1, s)            # same step numbers, different batches, never once equal
    # empty batches agree by accident; they do not make a group
    L.step(0, 50, digest="e" * 16, num_seqs=0)
    L.step(1, 50, digest="e" * 16, num_seqs=0)
    L.step(0, 51)
    L.step(1, 51)
    assert detect_group_divergence(L.events, at_ns=L.now) == []


def test_ranks_that_always_agree_are_not_a_finding(L):
    for w in range(4):
        L.worker(w)
    run_steps(L, range(1, 100), workers=(0, 1, 2, 3))
    assert detect_group_divergence(L.events, at_ns=L.now) == []


def test_explicit_groups_catch_a_divergence_from_the_first_step(L):
    L.worker(0)
    L.worker(1)
    run_steps(L, range(1, 6), diverge=set(range(1, 6)))
    assert detect_group_divergence(L.events, at_ns=L.now) == []     # never agreed: not known to be a group
    [f] = detect_group_divergence(L.events, at_ns=L.now, params=DiagnoseParams(groups={"tp": [0, 1]}))
    assert f.subject == "group tp" and f.detail["first_step"] == 1


def test_ranks_a_worker_joined_names_diverge_on_their_block_tables_and_the_stop_ends_it(L):
    for w in range(3):
        L.add(ev.WorkerJoined(worker=w, device="cpu", block_bytes=4096, tiers={"device": 1 << 20},
                              group="tp0", rank=w))
    recs = {}
    for s in range(1, 6):
        batch = f"{L.rng.getrandbits(64):016x}"
        for w in range(3):
            tables = "bad" if (w == 2 and s >= 4) else "same"
            recs[(s, w)] = L.add(ev.StepCompleted(worker=w, step=s, batch_digest=batch, num_seqs=1, num_tokens=1,
                                                  duration_ns=MS, tables_digest=tables))
    stop = L.add(ev.GroupStopped(group="tp0", reason="ranks diverged at step 4", step=4))
    for w in range(3):          # the step the ranks had in flight when the stop came: not a new episode
        L.add(ev.StepCompleted(worker=w, step=6, batch_digest="b", num_seqs=1, num_tokens=1, duration_ns=MS,
                               tables_digest="bad" if w == 2 else "same"))
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.subject == "group tp0"                 # named by WorkerJoined, though batches agreed
    assert f.onset_ns == recs[(4, 0)].envelope.ts_ns and f.detail["first_step"] == 4
    assert f.until_ns == stop.envelope.ts_ns and "stopped: ranks diverged at step 4" in f.title


def test_a_split_caught_by_the_ballot_shows_its_onset_and_that_no_rank_ran_the_step(L):
    for w in range(2):
        L.add(ev.WorkerJoined(worker=w, device="cpu", block_bytes=4096, tiers={"device": 1 << 20},
                              group="tp0", rank=w))
    for s in range(1, 4):
        batch = f"{L.rng.getrandbits(64):016x}"
        for w in range(2):
            L.add(ev.StepCompleted(worker=w, step=s, batch_digest=batch, num_seqs=1, num_tokens=1, duration_ns=MS,
                                   tables_digest="t"))
    a, b = (f"{L.rng.getrandbits(64):016x}" for _ in range(2))
    div = L.add(ev.GroupDiverged(group="tp0", step=4, digests_by_rank={"0": a, "1": b}, caught_by="ballot",
                                 round=6, request_id="cmpl-9"))
    stop = L.add(ev.GroupStopped(group="tp0", reason="ranks' ballots differ for request cmpl-9", step=4))
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.subject == "group tp0" and f.onset_ns == div.envelope.ts_ns and f.until_ns == stop.envelope.ts_ns
    assert f.detail["first_step"] == 4 and f.detail["caught_by"] == "ballot"
    assert f.detail["ballot_round"] == 6 and f.detail["request_id"] == "cmpl-9"
    assert "caught before step 4 ran, by the ranks' ballots of round 6 for request cmpl-9" in f.title
    assert f"rank 0={a[:8]}" in f.title and f"rank 1={b[:8]}" in f.title


def test_a_split_caught_after_the_step_says_so(L):
    L.worker(0)
    L.worker(1)
    run_steps(L, range(1, 6), diverge={3})
    [f] = detect_group_divergence(L.events, at_ns=L.now)
    assert f.detail["caught_by"] == "step" and f.detail["request_id"] is None and "ballot" not in f.title
