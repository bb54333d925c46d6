"""bench/moe.py runs end to end on the CPU at a tiny size and writes its JSON (figures at this
size mean nothing; nothing here times anything): a bench that no longer starts, or drops a key
its table reads, fails."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_moe_bench_runs_its_three_engines_on_the_cpu(tmp_path, monkeypatch):
    out = tmp_path / "moe.json"
    monkeypatch.setenv("RESIDENCY_GIT_COMMIT", "abc123")
    p = subprocess.run([sys.executable, "bench/moe.py", "--cpu", "--batches", "1,3", "--steps", "2",
                        "--prompt-tokens", "8", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["git_commit"] == "abc123" and res["bandwidth_gbs"] > 0
    assert [r["batch"] for r in res["decode"]] == [1, 3]
    for r in res["decode"]:
        assert 1 <= r["experts_hit_per_layer"] <= 16
        for key in ("fused_tok_s", "loop_tok_s", "transformers_tok_s", "fused_fraction_of_roofline"):
            assert r[key] > 0, key
        assert r["fused_equals_loop_tokens"] and r["tokens_equal_transformers"] == 1.0   # fp32
    for t in res["targets"].values():
        assert set(t) == {"measured", "target", "met"}
    assert "fused_and_loop_decode_the_same_tokens" in res["targets"]


def test_the_moe_offload_bench_decodes_the_resident_tokens_and_counts_the_moves_it_served(tmp_path, monkeypatch):
    out = tmp_path / "offload.json"
    monkeypatch.setenv("RESIDENCY_GIT_COMMIT", "abc123")
    p = subprocess.run([sys.executable, "bench/moe.py", "--cpu", "--offload", "--offload-batches", "1,3", "--steps", "3",
                        "--prompt-tokens", "8", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bench"] == "moe-offload" and res["git_commit"] == "abc123" and res["model"] == "tiny-olmoe"
    rows = res["offload"]
    assert [(r["batch"], r["budget"]) for r in rows] == [(b, g) for b in (1, 3) for g in ("100%", "50%", "25%")]
    for r in rows:
        assert r["tokens_equal_resident"] and r["tok_s"] > 0, r
        moved = r["moves"]
        # every byte the steps routed was served from a slot or fetched for it, and a fetch served
        # is a fetch the bench counted from the drained moves (and the other way round)
        assert moved["served_device_bytes"] + moved["served_fetched_bytes"] > 0
        assert (moved["fetch"] > 0) == (moved["served_fetched_bytes"] > 0), moved
        if r["budget"] == "100%":
            assert moved["copied_bytes"] == 0 and moved["served_fetched_bytes"] == 0, moved
    assert rows[-1]["moves"]["copied_bytes"] > 0          # batch 3 through a quarter of the experts
    assert {"offloaded_tokens_equal_resident", "budget_100_served_from_device"} <= set(res["targets"])
