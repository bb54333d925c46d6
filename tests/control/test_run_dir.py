"""The run dir (sockets, lock, peer key, KV files) is private to its user, or serve does not start."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from residency.control.cli.main import UserError
from residency.control.cli.run_dir import check_private, open_run_dir, run_key

RESIDENCY = [sys.executable, "-c", "import sys; from residency.control.cli.main import main; sys.exit(main(sys.argv[1:]))"]


def _serve(tmp_path, *argv, env=None):
    return subprocess.run([*RESIDENCY, "serve", "--model", "none", "--db", f"sqlite:///{tmp_path / 'l.db'}", *argv],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_serve_refuses_a_run_dir_that_others_may_write(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o777)
    out = _serve(tmp_path, "--run-dir", str(d))
    assert out.returncode == 2, out.stderr
    assert f"run dir {d} has mode 777" in out.stderr
    assert not (d / "serve.lock").exists() and not (tmp_path / "l.db").exists()    # nothing started


def test_serve_refuses_a_default_root_someone_made_first(tmp_path):
    # the default root is a predictable path in the shared temp dir: one made open beforehand is refused
    root = tmp_path / f"residency-{os.getuid()}"
    root.mkdir()
    root.chmod(0o1777)
    out = _serve(tmp_path, env={"TMPDIR": str(tmp_path), "RESIDENCY_RUN_ROOT": ""})
    assert out.returncode == 2, out.stderr
    assert f"run dir {root} has mode 1777" in out.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_run_dir_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    with pytest.raises(UserError, match="belongs to uid 12345"):
        open_run_dir(d)


def test_a_link_is_not_a_run_dir(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UserError, match="not a directory"):
        check_private(tmp_path / "link")


def test_a_new_run_dir_and_its_key_are_private_and_the_key_survives_a_restart(tmp_path):
    old = os.umask(0o022)
    try:
        root = tmp_path / "root"
        run = open_run_dir(root / "abc", root)
        key = run_key(run)
    finally:
        os.umask(old)
    assert _mode(root) == 0o700 and _mode(run) == 0o700 and _mode(run / "peer.key") == 0o600
    assert run_key(run) == key and len(key) == 32       # a restarted serve adopts workers with it
    (run / "peer.key").chmod(0o640)
    with pytest.raises(UserError, match="mode 640"):
        run_key(run)


def test_a_new_sqlite_ledger_is_private_and_an_existing_file_keeps_its_mode(tmp_path):
    from residency.ledger import LedgerStore

    old = os.umask(0o022)
    try:
        LedgerStore.open(f"sqlite:///{tmp_path / 'new.db'}", create=True).close()
        (tmp_path / "mine.db").touch(mode=0o640)
        LedgerStore.open(f"sqlite:///{tmp_path / 'mine.db'}", create=True).close()
    finally:
        os.umask(old)
    assert _mode(tmp_path / "new.db") == 0o600
    assert _mode(tmp_path / "mine.db") == 0o640
