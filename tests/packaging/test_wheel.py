"""The installed distribution claims one top-level name, `residency`, and lives beside the PyPI
distributions whose names our folders share (`kernels`, `events`, `control`).

The wheel is built from this checkout and installed into a fresh virtualenv with PyPI's `kernels`,
`events` and `control`; the test venv's site-packages is appended to that venv's path (after its own),
so our dependencies import without a second download; theirs are installed with their own.
"""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["control", "dataplane", "events", "kernels", "ledger", "migrations"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")   # not the checkout's build/: a stale one would leak old files
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, cwd=build, env={**_env(), "TMPDIR": str(build)})
    (whl,) = out.glob("residency-*.whl")
    return whl


def _env() -> dict[str, str]:
    import os
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_the_wheel_claims_exactly_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["residency"]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"residency"}, tops
    assert {n.split("/")[1] for n in names if n.startswith("residency/") and n.count("/") > 1} == set(FOLDERS)
    assert "residency/migrations/alembic.ini" in names
    assert any(n.startswith("residency/migrations/versions/") and n.endswith(".py") for n in names)
    assert not any(n.startswith("residency/tests/") or n.startswith("residency/bench/") for n in names)


def test_installed_beside_the_pypi_kernels_events_and_control_both_sides_import(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, env=_env())
    subprocess.run([*pip, "kernels", "events", "control"], check=True, env=_env())
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "zz_test_venv_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = f"""
import importlib.metadata as md, os, sys
site = {site!r}
import kernels, events, control
import residency.kernels, residency.events, residency.control.cli.main, residency.dataplane.pools, residency.ledger
from residency.ledger.migrate import head, _location
theirs = {{m.__name__: m.__file__ for m in (kernels, events, control)}}
ours = {{m.__name__: m.__file__ for m in (residency.kernels, residency.events, residency.control.cli.main)}}
for name, f in {{**theirs, **ours}}.items():
    assert f.startswith(site), (name, f)
assert theirs["kernels"].endswith(os.path.join("kernels", "__init__.py"))
assert ours["residency.kernels"].endswith(os.path.join("residency", "kernels", "__init__.py"))
assert hasattr(control, "TransferFunction") and hasattr(events, "Events") and hasattr(kernels, "get_kernel")
assert (_location() / "alembic.ini").is_file() and head()
assert md.distribution("residency").read_text("top_level.txt").split() == ["residency"]
print("ok")
"""
    # Run from an empty folder so the checkout's folders are not on the path.
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=_env())
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
