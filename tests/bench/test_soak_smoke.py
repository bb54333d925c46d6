"""bench/soak.py end to end for a few seconds: a real `residency serve`, two users, a few hostile
kinds and one SIGKILL of the control process, restarted on the same ledger. It checks that the
soak runs and writes every figure and target its table reads; whether the targets are met is the
soak's own verdict (a run records it), never asserted here, and nothing is timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

TARGETS = {"unanswered", "unclosed", "verify_ok", "stranded_double_counted_bytes",
           "stranded_audit_view_replay_agree", "replay_integrity_ok", "serving_after"}


def test_the_soak_kills_the_control_process_once_and_writes_its_figures_and_targets(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, "bench/soak.py", "--duration", "5", "--clients", "2",
                        "--hostile", "malformed_json,unknown_fields,park_session,delete_session",
                        "--hostile-fraction", "0.4", "--kill-every", "3", "--control-share", "1",
                        "--client-timeout", "20", "--think", "0.5", "--seed", "7", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert set(res["targets"]) == TARGETS
    for v in res["targets"].values():
        assert set(v) == {"measured", "target", "met"} and v["met"] == (v["measured"] == v["target"])
    assert res["git_commit"] and res["requests_sent"] > 0
    assert sum(res["requests_by_result"].values()) == res["requests_sent"]
    assert [k["target"] for k in res["kills"]] == ["control"] and res["serve_starts"] == 2
    assert res["verify"]["returncode"] is not None and res["ledger"]["requests_admitted"] > 0
    for key in ("stranded_view_bytes", "stranded_once_bytes", "stranded_overlap_in_rows_bytes", "requests_unclosed",
                "requests_closed_control_lost"):
        assert isinstance(res["ledger"][key], int), key
    assert isinstance(res["stranded_audit_bytes"], int) and "stranded_bytes" in res["replay"]
    assert isinstance(res["stranded_double_counted_bytes"], int)
    assert res["final_request"]["ok"] is True       # the server answers after the run: a liveness check
    assert "target serving_after:" in p.stdout and "ledger verify:" in p.stdout
