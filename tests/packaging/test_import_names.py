"""Every import of ours says `residency.`: a bare `control`, `kernels`, `events` ... would find the
checkout's folder only when the checkout happens to be on sys.path, and PyPI's package of that
name otherwise. Strings count too (code run by `python -c`, module paths for `-m`)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = "control|dataplane|events|kernels|ledger|migrations"
BARE = re.compile(rf"(?:^|[\s;\"'(])(?:from (?:{FOLDERS})(?:\.\w+)* import |import (?:{FOLDERS})(?:\.\w+)*(?:[\s,;]|$))"
                  rf"|\"-m\", \"(?:{FOLDERS})\.", re.M)
ALLOWED = {Path("tests/packaging/test_wheel.py")}     # imports PyPI's kernels, events and control on purpose


def test_no_source_file_imports_our_folders_by_their_bare_names():
    offenders = []
    for folder in ("control", "dataplane", "events", "kernels", "ledger", "migrations", "tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel in ALLOWED:
                continue
            for m in BARE.finditer(path.read_text()):
                line = path.read_text().count("\n", 0, m.start()) + 1
                offenders.append(f"{rel}:{line}: {m.group(0).strip()}")
    assert not offenders, "\n".join(offenders)
