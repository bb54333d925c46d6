"""bench/serve_e2e.py at its smallest size against real `residency serve` processes (both
variants, one level of two users, two turns each), and the pure arithmetic its table rests on.
The smoke checks that the bench runs, that no request failed and that the JSON carries every
figure and target its table reads; whether a target is met is the bench's verdict, never asserted
here, and nothing is timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from e2e_users import Turn, pct, summarize, union_s  # noqa: E402

LEVEL_KEYS = {"requests", "requests_failed", "output_tok_s", "decode_tok_s", "decode_streams_mean",
              "ttft_first_ms_p50", "ttft_first_ms_p99", "ttft_returning_ms_p50", "ttft_returning_ms_p99",
              "itl_ms_p50", "itl_ms_p99", "prefix_decisions", "moves", "bytes_moved", "bytes_moved_by_kind",
              "ledger_lag_ms_p99", "ledger_lag_samples", "turns"}


@pytest.mark.slow
def test_the_smallest_e2e_run_answers_every_request_and_writes_each_figure_and_target(tmp_path):
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, "bench/serve_e2e.py", "--smoke", "--no-baselines", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["bench"] == "serve_e2e" and res["git_commit"]
    assert set(res["variants"]) == {"shipped", "tiering_off"}
    for name, v in res["variants"].items():
        assert "error" not in v, (name, v.get("error"), v.get("log_tail"))
        assert list(v["levels"]) == ["2"]
        lv = v["levels"]["2"]
        assert LEVEL_KEYS <= set(lv), LEVEL_KEYS - set(lv)
        assert lv["requests"] == 4 and lv["requests_failed"] == 0, lv["failures"]
        assert lv["first_turns"] == 2 and lv["returning_turns"] == 2
        assert all(t["prompt_tokens"] and t["completion_tokens"] == 4 for t in lv["turns"])
        assert lv["ledger_lag_samples"] > 0
    # the shipped server restores the parked histories; with tiering off it recomputes them
    assert res["variants"]["shipped"]["levels"]["2"]["prefix_decisions"].get("restore", 0) > 0
    assert res["variants"]["tiering_off"]["levels"]["2"]["prefix_decisions"].get("restore", 0) == 0
    assert res["variants"]["tiering_off"]["levels"]["2"]["prefix_decisions"].get("recompute", 0) > 0
    targets = res["targets"]
    assert {"returning_ttft_p50_speedup_vs_tiering_off_longest", "requests_failed", "ledger_lag_p99_ms_at_2",
            "served_decode_vs_runner_at_2"} == set(targets)
    for v in targets.values():
        assert set(v) == {"measured", "target", "met"}
    assert targets["requests_failed"]["measured"] == 0 and targets["requests_failed"]["met"]
    # no baselines were asked for: the ratio to the runner is not measured, and so not met
    assert targets["served_decode_vs_runner_at_2"] == {"measured": None, "target": 0.8, "met": False}
    assert "target requests_failed: 0" in p.stdout


def test_busy_decode_time_counts_overlapping_streams_once():
    assert union_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_s([]) == 0.0


def test_a_failed_turn_is_counted_and_left_out_of_the_latencies():
    ok = Turn(user=0, turn=1, sent_ns=10**9, ok=True, ttft_s=0.5, last_token_s=1.5, gaps_s=[0.25] * 4,
              prompt_tokens=100, completion_tokens=5)
    failed = Turn(user=1, turn=0, sent_ns=10**9, error="HTTP 503: draining", ttft_s=9.0)
    s = summarize([ok, failed], wall_s=2.0)
    assert s["requests"] == 2 and s["requests_failed"] == 1 and s["failures"] == ["HTTP 503: draining"]
    assert s["ttft_first_ms_p50"] is None                # not measured: the only first turn failed
    assert s["ttft_returning_ms_p50"] == pytest.approx(500.0)
    assert s["output_tok_s"] == pytest.approx(2.5) and s["decode_tok_s"] == pytest.approx(4.0)


def test_percentiles_are_nearest_rank_and_none_when_nothing_was_measured():
    assert pct([], 99) is None
    assert pct([3.0, 1.0, 2.0], 50) == 2.0
    assert pct(list(range(1, 101)), 99) == 99
