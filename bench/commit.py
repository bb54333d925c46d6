"""The commit a bench result names: one helper for every bench under bench/.

RESIDENCY_GIT_COMMIT wins when set: the device machine receives the working tree with a copy of
.git that can be older than it, so a GPU run must be told what it runs (bench/gpu_session.sh
says how). Otherwise ``git rev-parse HEAD`` of this checkout, with "-dirty" when any of
``watch`` (paths relative to the repository root) differs from HEAD; "unknown" where there is no
git at all.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit(watch: tuple[str, ...] = ()) -> str:
    if os.environ.get("RESIDENCY_GIT_COMMIT"):
        return os.environ["RESIDENCY_GIT_COMMIT"]
    try:
        rev = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                      cwd=ROOT).strip()
    except Exception:  # noqa: BLE001 - no git, or not a checkout
        return "unknown"
    if watch and subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *watch], cwd=ROOT).returncode != 0:
        return rev + "-dirty"
    return rev
