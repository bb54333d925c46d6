"""The run directory of `residency serve`: private to its user, or the server does not start.

It holds the sockets, the pid files, the lock, the peer key and each worker's disk tier (KV
bytes), under a predictable default path (``<temp dir>/residency-<uid>/<ledger digest>``), so
anyone could create it first. Each directory on the way that we would trust is checked:

    <root>        created 0700 if missing; else it must be ours and closed to group and others
    <run dir>     the same
    peer.key      created 0600 once; later runs (a restart adopting live workers) read it back
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from residency.control.cli.main import UserError
from residency.events.handshake import KEY_FILE, PeerKeyError, new_key_file, read_key_file


def check_private(path: Path) -> None:
    """Raise UserError unless ``path`` is a real directory owned by this user with mode 0700 (or
    narrower): another user who owns or may write it could swap the sockets or read the KV files."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UserError(f"run dir {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"run dir {path} is not a directory (a link or a file): refusing to use it")
    if st.st_uid != os.getuid():
        raise UserError(f"run dir {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                        "refusing to use it; choose another --run-dir")
    if st.st_mode & 0o077:
        raise UserError(f"run dir {path} has mode {stat.S_IMODE(st.st_mode):o}: group or others may enter it "
                        f"(it must be 700; `chmod 700 {path}` if it is yours)")


def _make_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)     # the umask may only narrow it
    except FileExistsError:
        pass
    check_private(path)


def open_run_dir(path: Path, default_root: Path | None = None) -> Path:
    """Create ``path`` (and ``default_root`` above it, when it is the derived default) private, or
    check that they already are."""
    if default_root is not None:
        default_root.parent.mkdir(parents=True, exist_ok=True)
        _make_private(default_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    _make_private(path)
    return path


def run_key(run_dir: Path) -> bytes:
    """The run's peer key: read back if a run left one (its workers may still be alive), else new."""
    path = run_dir / KEY_FILE
    try:
        if os.path.lexists(path):
            return read_key_file(path)
        return new_key_file(path)
    except (PeerKeyError, OSError) as e:
        raise UserError(str(e)) from None


def drop_key(run_dir: Path) -> None:
    """After a clean stop (no worker left alive), so the next run makes a fresh key."""
    try:
        (run_dir / KEY_FILE).unlink()
    except FileNotFoundError:
        pass
