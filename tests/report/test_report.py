import re

from sqlalchemy import text

from residency.events import catalog as ev
from residency.control.report import build_report, collect
from residency.ledger import LedgerStore
from tests.diagnose.ledgers import simulated


def wedged(L):
    L.worker(0)
    L.worker(1)
    L.add(ev.BudgetSet(worker=0, tier="device", floor_bytes=4 * L.block_bytes[0], ceiling_bytes=64 * L.block_bytes[0]))
    for i in range(30):
        L.step(i % 2, i, dt_ms=100)
        L.move(i % 2, L.rng.choice(["spill", "evict"]), "device", "host", L.commit(i % 2, L.rng.randrange(1, 5)))
    session = L.uid("s")
    mid, _ = L.request_move(1, "restore", "host", "device", L.commit(1, 3, tier="host", session=session),
                            session=session, deadline_ms=100)
    L.admit(session=session)
    L.chatter(20)
    return mid


def test_the_report_is_one_file_that_needs_nothing_from_the_network(L):
    wedged(L)
    html = build_report(L.events, "test")
    assert html.startswith("<!DOCTYPE html>")
    # nothing to fetch: no external script, stylesheet, image, font or frame
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html and "<iframe" not in html
    assert html.count("<svg") >= 10


def test_the_findings_are_placed_on_the_timeline_and_listed_with_their_proof(L):
    mid = wedged(L)
    d, _ = collect(L.events)
    html = build_report(L.events, "test")
    wedge = next(i for i, f in enumerate(d.findings) if f.detector == "overdue_move")
    bar = re.search(rf'<rect class="bar ongoing"[^>]*data-finding="{wedge}"><title>([^<]*)</title>', html)
    assert bar and mid in bar.group(1)
    row = re.search(rf'<tr id="f-{wedge}">(.*?)</tr>', html, re.S)
    assert row and mid in row.group(1) and f"seq {d.findings[wedge].seqs[0]}" in row.group(1)


def test_every_plot_the_operator_needs_is_there(L):
    wedged(L)
    html = build_report(L.events, "test")
    for chart_id in ("findings", "bytes-device", "bytes-host", "moves-requested", "moves-outcomes", "moves-inflight",
                     "stranded", "refusals", "requests-waiting"):
        assert f'id="{chart_id}"' in html, chart_id
    for heading in ("Reclaimed bytes", "Stranded bytes outstanding", "Events by type"):
        assert heading in html


_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _figure(html: str, chart_id: str) -> str:
    return re.search(rf'<figure class="chart" id="{chart_id}">(.*?)</figure>', html, re.S).group(1)


def _axis_top_bytes(fig: str) -> float:
    labels = re.findall(r'<text class="ylab"[^>]*>([^<]*)</text>', fig)
    return max(float(v) * _UNIT[u] for v, u in (lab.split() for lab in labels if " " in lab))


def _host_use(L, host_blocks: int, num_committed: int) -> tuple[int, int]:
    """A worker whose host tier holds ``num_committed`` blocks, then frees some: (peak bytes, capacity)."""
    bb = L.worker(0, host_blocks=host_blocks)
    blocks = L.commit(0, num_committed, tier="host", dt_ms=200)
    L.step(0, 1, dt_ms=500)
    L.free(0, blocks[: num_committed // 2], tier="host", dt_ms=500)
    L.step(0, 2, dt_ms=500)
    return num_committed * bb, host_blocks * bb


def test_a_bytes_panel_is_scaled_to_its_data_not_to_a_capacity_far_above(L):
    peak, capacity = _host_use(L, host_blocks=8192, num_committed=L.rng.randrange(3, 9))
    fig = _figure(build_report(L.events, "test"), "bytes-host")
    top = _axis_top_bytes(fig)
    assert peak <= top < 2 * peak < capacity, (peak, top, capacity)
    assert "capacity" in fig and "above this scale" in fig
    assert "stroke-dasharray" not in fig, "the capacity line is named, not drawn off the plot"


def test_a_capacity_near_the_data_is_drawn_on_the_scale(L):
    # use at 55-65 % of the capacity: an axis rounded up from the use alone would stop below it
    host_blocks = L.rng.randrange(20, 41)
    num_committed = L.rng.randint(-(-host_blocks * 55 // 100), host_blocks * 65 // 100)
    peak, capacity = _host_use(L, host_blocks=host_blocks, num_committed=num_committed)
    fig = _figure(build_report(L.events, "test"), "bytes-host")
    assert capacity <= _axis_top_bytes(fig) < 2 * capacity
    assert "stroke-dasharray" in fig and "above this scale" not in fig


def test_an_empty_ledger_makes_a_report_too():
    html = build_report([], "empty")
    assert "no findings" in html.lower() and html.count("<svg") >= 1


def test_a_large_ledger_makes_a_small_file():
    events = simulated(30_000, seed=5)
    html = build_report(events, "sim")
    assert len(html) < 3_000_000
    assert len(build_report(events, "sim", num_bins=60)) < len(html)


def test_the_audit_totals_are_the_ledger_views_totals(tmp_path):
    url = f"sqlite:///{tmp_path}/l.db"
    with LedgerStore.open(url, create=True) as store:
        store.append([(r.envelope, r.event) for r in simulated(30_000, seed=5)])
        events = list(store.read())
        with store.engine.connect() as conn:
            reclaimed = dict(conn.execute(text("SELECT tier, SUM(bytes) FROM residency_reclaimed GROUP BY tier")).all())
            stranded = dict(conn.execute(text("SELECT why, SUM(bytes) FROM residency_stranded GROUP BY why")).all())
    _, col = collect(events)
    mine: dict[str, int] = {}
    for (tier, _), b in col.reclaimed.items():
        mine[tier] = mine.get(tier, 0) + b
    assert mine == {t: b for t, b in reclaimed.items() if b}
    assert {w: b for w, b in col.stranded_by_why.items() if b} == {w: b for w, b in stranded.items() if b}
