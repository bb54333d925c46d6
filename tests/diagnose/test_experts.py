"""An offloaded MoE model in the ledger: expert thrash is found on a thrashing ledger and only
there; `residency audit experts` gives the bytes per tier and expert over time."""
from __future__ import annotations

import json

from residency.control.cli.main import main
from residency.control.diagnose import detect_expert_thrash, diagnose
from residency.events import catalog as ev
from residency.ledger import LedgerStore
from tests.diagnose.ledgers import Ledger

LAYERS, EXPERTS, SLOTS = 4, 8, 4


def moved(L, w: int, step: int, moves: list[tuple[str, int, int]], *, dt_ms: float = 20.0,
          served: tuple[int, int] = (0, 0)) -> ev.ExpertsMoved:
    eb = L.expert_bytes
    ms = [ev.ExpertMove(kind=k, layer=layer, expert=e, bytes=eb, ns=0 if k == "evict" else L.rng.randrange(10**5, 10**6))
          for k, layer, e in moves]
    L.resident += sum(1 for k, *_ in moves if k != "evict") - sum(1 for k, *_ in moves if k == "evict")
    e = ev.ExpertsMoved(worker=w, step=step, moves=ms, fetched_bytes=sum(m.bytes for m in ms if m.kind != "evict"),
                        device_bytes=L.resident * eb, host_bytes=LAYERS * EXPERTS * eb,
                        served_device_bytes=served[0] * eb, served_fetched_bytes=served[1] * eb,
                        num_layers=LAYERS, num_experts=EXPERTS)
    L.add(e, dt_ms=dt_ms)
    return e


def placed(L, w: int = 0) -> None:
    L.expert_bytes = L.rng.randrange(1, 64) * (1 << 16)
    L.resident = 0
    L.worker(w)
    moved(L, w, 0, [("fetch", layer, e) for layer in range(LAYERS) for e in range(SLOTS)])


def healthy(L, steps: int = 60) -> None:
    """Each layer's hot set settles: a few experts swap in once and stay."""
    placed(L)
    for s in range(1, steps):
        moves = []
        if s < LAYERS + 1:                         # layer s-1 trades its coldest once for a hotter one
            moves = [("evict", s - 1, 3), ("fetch", s - 1, 4 + s % 4)]
        if moves:
            moved(L, 0, s, moves, served=(7, 1))


def thrashing(L, rounds: int = 5) -> list[int]:
    """Layer 2: experts 1 and 6 keep taking each other's slot, a step apart."""
    placed(L)
    seqs = []
    for r in range(rounds):
        moved(L, 0, 2 * r + 1, [("evict", 2, 1), ("fetch", 2, 6)], served=(7, 1))
        seqs.append(L.seq)
        moved(L, 0, 2 * r + 2, [("evict", 2, 6), ("fetch", 2, 1)], served=(7, 1))
        seqs.append(L.seq)
    return seqs


def test_expert_thrash_is_found_on_a_thrashing_ledger_with_its_seqs(L):
    seqs = thrashing(L)
    (f,) = detect_expert_thrash(L.events, L.now)
    assert f.detector == "expert_thrash" and f.subject == "worker 0 experts" and f.until_ns is None
    assert set(f.detail["experts"]) == {"L2/E1", "L2/E6"}
    assert set(f.seqs) <= set(seqs) | {2} and len(f.seqs) >= 3
    # once the traffic settles, the episode ends (and is still reported, with its end)
    L.wait(120)
    moved(L, 0, 99, [("fetch", 3, 7)])
    (f,) = detect_expert_thrash(L.events, L.now)
    assert f.until_ns is not None and f.until_ns < L.now


def test_a_healthy_offload_has_no_expert_thrash(L):
    healthy(L)
    assert detect_expert_thrash(L.events, L.now) == []
    assert not [f for f in diagnose(L.events).findings if f.detector == "expert_thrash"]


def test_moves_spread_wider_than_the_window_are_no_thrash(L):
    placed(L)
    for r in range(5):
        L.wait(40)
        moved(L, 0, 2 * r + 1, [("evict", 2, 1), ("fetch", 2, 6)])
        moved(L, 0, 2 * r + 2, [("evict", 2, 6), ("fetch", 2, 1)])
    assert detect_expert_thrash(L.events, L.now) == []


def test_audit_experts_gives_bytes_per_tier_and_expert_over_time(L, tmp_path, capsys):
    thrashing(L, rounds=3)
    url = f"sqlite:///{tmp_path}/experts.db"
    with LedgerStore.open(url, create=True) as store:
        store.append([(r.envelope, r.event) for r in L.events])
    assert main(["audit", "experts", "--db", url, "--json", "--limit", "100"]) == 0
    (w,) = json.loads(capsys.readouterr().out)["workers"]
    eb = L.expert_bytes
    assert w["tiers"] == {"host": LAYERS * EXPERTS * eb, "device": LAYERS * SLOTS * eb}
    assert w["served_from_device"] == 7 / 8
    assert w["copied_bytes"] == (LAYERS * SLOTS + 6) * eb and w["demand_fetch_bytes"] == w["copied_bytes"]
    by = {(x["layer"], x["expert"]): x for x in w["experts"]}
    assert (by[(2, 1)]["fetches"], by[(2, 1)]["evictions"], by[(2, 1)]["tier_now"]) == (4, 3, "device+host")
    assert (by[(2, 6)]["fetches"], by[(2, 6)]["evictions"], by[(2, 6)]["tier_now"]) == (3, 3, "host")
    # the steps are evenly spaced: the two took turns, half the span each; the others never left
    assert by[(2, 1)]["device_share"] == by[(2, 6)]["device_share"] == 0.5 and by[(0, 0)]["device_share"] == 1.0
    points = w["device_bytes_over_time"]
    assert points[0]["device_bytes"] == LAYERS * SLOTS * eb and len(points) == 12
    assert w["measured_gbs"] > 0 and w["demand_fetch_wait_s_priced"] > 0
    assert main(["audit", "experts", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "served from the device: 87.5%" in out and "device expert bytes over time" in out


def test_the_report_draws_expert_bytes_over_time_and_lists_the_thrashing_experts(L):
    from residency.control.report import build_report

    thrashing(L)
    html = build_report(L.events, "test")
    assert 'data-chart="experts-device"' in html and "worker 0 experts on device" in html
    table = html[html.index("Experts moved most"):]
    assert "<td class=\"num\">2</td><td class=\"num\">1</td>" in table and "expert_thrash" in html
    plain = Ledger(L.rng.randrange(1 << 30))
    plain.worker(0)
    assert 'data-chart="experts-device"' not in build_report(plain.events, "test")
