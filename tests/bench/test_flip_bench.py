"""bench/flip.py runs end to end on a CPU with tiny images and writes the JSON the GPU run fills
(its figures mean nothing at this size; nothing here times anything)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_flip_bench_compares_flip_duplex_sequential_and_reload_and_checks_every_flip(tmp_path):
    out = tmp_path / "flip.json"
    p = subprocess.run([sys.executable, "bench/flip.py", "--device", "cpu", "--image-gib", "0.004", "--dim-scale", "32",
                        "--chunk-mib", "0.25", "--rounds", "1", "--tmp-dir", str(tmp_path), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    t = r["targets"]["flip_vs_duplex"]
    assert set(t) == {"measured", "target", "met"} and t["target"] == 0.9
    assert r["steady"]["checksum_ok_all"] and r["reload"]["checksum_ok"]
    assert r["leak_check"]["pinned_in_use_equal"] and r["leak_check"]["device_allocated_equal"] is None
    assert r["priming"]["bytes_out"] == r["priming"]["bytes_in"] == r["config"]["image_bytes"]
    assert r["steady"]["overlapped_steps"] == r["steady"]["steps"] - 1 > 0
    assert r["git_commit"] and r["duplex_GBps"] > 0 and r["sequential_GBps"] > 0
