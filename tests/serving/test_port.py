"""The serving scheduler declares the port it serves (``control/scheduler/port.py``); the HTTP API
depends on it, never the other way round, so the scheduler runs and is tested without FastAPI."""
from __future__ import annotations

import ast
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parents[2] / "control" / "scheduler"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_no_scheduler_module_imports_the_http_api():
    files = sorted(SCHEDULER.glob("*.py"))
    assert len(files) > 5, f"no scheduler modules found under {SCHEDULER}"
    offenders = {f.name: m for f in files for m in _imports(f)
                 if m.startswith(("residency.control.api", "control.api", "fastapi"))}
    assert not offenders, f"the scheduler imports the API: {offenders}"
