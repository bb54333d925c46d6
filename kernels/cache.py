"""A Triton kernel cache that the worker processes of one host share safely.

Triton keeps each compiled kernel under ``TRITON_CACHE_DIR/<key>/``: the IR of every stage, the
cubin, a metadata JSON and a ``__grp__<name>.json`` listing them. ``triton.compile`` asks the
cache manager for the group; on a miss it compiles, puts each file, then puts the group. Stock
``FileCacheManager`` makes each *file* atomic (a private temp dir, then ``os.replace``), but not
the *compile*: N ranks starting together all miss, all compile, and all publish the same names,
so a rank may read back one writer's cubin beside another's metadata (they agree only if code
generation is bit-deterministic, and the metadata carries sizes such as shared memory that must
match the binary), and the host compiles every kernel N times at start.

``SharedCacheManager`` makes a compile a transaction per key across processes:

    rank A: get_group miss ─► lock <key>/lock ─► recheck: still a miss ─► compile ─► put files ─► put_group ─► unlock
    rank B: get_group miss ─► lock (waits for A)                   ...────────────────────────────► recheck: hit
A hit never takes the lock. The same holds for single files fetched with ``get_file`` (the
launcher ``.so`` built once per host; autotuning results): a miss locks until that name is put.
Every process therefore ends with the first writer's bytes, and a reader sees a group only after
every file it lists was published (each with write, fsync, rename). The lock is an ``flock`` on
an open file: a compiler that dies releases it with its descriptor; one that raises releases it
when its manager is dropped; a waiter gives up after ``LOCK_WAIT_S`` and compiles on its own
(every put stays atomic, so that costs a duplicate compile, never a torn file).

Workers set it up with ``install_shared_cache()`` before their first kernel is built: it names
this class in ``TRITON_CACHE_MANAGER`` and, unless the operator set ``TRITON_CACHE_DIR``, points it
at a per-host directory (a home directory on a network filesystem shared by several hosts is
where Triton's own put fails: EBUSY from the temp-dir cleanup, triton-lang/triton#11512).
``kernels._common`` calls it before building any compiled kernel.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
import time

try:
    from triton.runtime.cache import FileCacheManager
except ImportError:  # pragma: no cover - CPU-only host without triton: nothing is compiled
    FileCacheManager = object

MANAGER = "residency.kernels.cache:SharedCacheManager"
LOCK_WAIT_S = 600.0          # longer than any compile we ship; past it a waiter compiles on its own


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME`` (or ``~/.cache``)``/residency/triton/<hostname>``: one per host."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "residency", "triton", socket.gethostname())


def install_shared_cache(cache_dir: str | None = None) -> str:
    """Make every Triton compile in this process (and the processes it starts) go through
    ``SharedCacheManager``; returns the cache directory. An operator's ``TRITON_CACHE_MANAGER`` is
    kept (their choice), as is their ``TRITON_CACHE_DIR`` unless ``cache_dir`` is given. Idempotent."""
    os.environ.setdefault("TRITON_CACHE_MANAGER", MANAGER)
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    elif not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = default_cache_dir()
    return os.environ["TRITON_CACHE_DIR"]


class SharedCacheManager(FileCacheManager):
    """Triton's file cache with one compile per key per host (see the module docstring)."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._lock_fd: int | None = None
        self._awaited: str | None = None      # the name whose put ends this process's compile

    # ------------------------------------------------------------ reads
    def get_group(self, filename: str) -> dict[str, str] | None:
        """The published group, or None: then this process holds the key's lock until it puts
        ``filename``'s group (it is the one compiling)."""
        return self._hit_or_lock(f"__grp__{filename}", lambda: self._complete_group(filename))

    def get_file(self, filename: str) -> str | None:
        """The published file's path, or None: then this process holds the key's lock until it
        puts ``filename``."""
        return self._hit_or_lock(filename, lambda: self._published(filename))

    def _hit_or_lock(self, awaited: str, lookup):
        found = lookup()
        if found is not None or self.lock_path is None:      # the override manager never writes
            return found
        if self._awaited is not None:                        # already compiling under this key
            return None
        if not self._lock():
            return lookup()                                  # waited too long: compile unlocked
        found = lookup()                                     # the writer we waited for published it
        if found is not None:
            self._unlock()
            return found
        self._awaited = awaited
        return None

    def _published(self, filename: str) -> str | None:
        path = self._make_path(filename)
        return path if os.path.exists(path) else None

    def _complete_group(self, filename: str) -> dict[str, str] | None:
        """The group's files when the group and every file it lists exist (Triton's own lookup
        returns the subset that exists, so a partial group would read as a hit)."""
        path = self._published(f"__grp__{filename}")
        if path is None:
            return None
        try:
            with open(path) as f:
                children = json.load(f).get("child_paths")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(children, dict) or not all(os.path.exists(p) for p in children.values()):
            return None
        return dict(children)

    # ------------------------------------------------------------ writes
    def put(self, data, filename, binary=True) -> str:
        """Publish ``filename`` atomically (write, fsync, rename in the key's directory); the put
        this process's compile was awaiting releases the key's lock."""
        if not self.cache_dir:
            raise RuntimeError("Triton cache: no cache directory")
        if not isinstance(data, bytes):
            data = str(data).encode("utf-8")
        path = self._make_path(filename)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=f".tmp.{os.getpid()}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _remove_quietly(tmp)
            raise
        if filename == self._awaited:
            self._awaited = None
            self._unlock()
        return path

    # ------------------------------------------------------------ the key's lock
    def _lock(self) -> bool:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return True
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() > deadline:
                os.close(fd)
                return False
            time.sleep(0.01)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)                                      # closing the descriptor drops the flock

    def __del__(self):
        # A compile that raised never puts its awaited file: its waiters get the key back here.
        self._unlock()


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
