"""The disk tier: one file per block under a directory, each carrying its own checksum.

File format (little-endian), 64-byte header then the block's bytes:

    off  size  field
      0     8  magic  b"RSDKVBL1"
      8     2  version (1)        10  2  header_bytes (64)     12  4  zero
     16     8  block_id           24  8  block_bytes
     32     8  checksum           psum64 of the payload under block_id (kernels.checksum)
     40    16  layout digest      KVLayout.digest(): a file never loads into another shape/dtype
     56     4  crc32 of bytes [0, 56)   (a damaged header is named as such)
     60     4  zero
     64     …  payload (block_bytes)

Writes go to ``.<name>.tmp`` and become visible by rename at ``publish``, so a crash never
leaves a half-written file under a block's name. After a restart ``rebuild`` scans the directory:
stale temporaries are deleted, files whose header, size or (with ``verify``) payload checksum is
wrong are moved to ``quarantine/`` (never silently deleted) and listed in the report; the rest
form the index. Usage counts payload bytes (``block_bytes`` per block), like the other tiers;
the 64-byte header per file is overhead outside the accounting.
"""
from __future__ import annotations

import os
import shutil
import struct
import time
import zlib
from pathlib import Path
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from residency.dataplane.pools.errors import (
    AlreadyResident,
    DiskCopyError,
    IntegrityError,
    NoRoom,
    NotResident,
)
from residency.dataplane.pools.layout import KVLayout

MAGIC = b"RSDKVBL1"
VERSION = 1
_HEADER = struct.Struct("<8sHHIQQQ16sI4x")
HEADER_BYTES = _HEADER.size
QUARANTINE_KEEP = 64          # quarantined files kept for inspection (the newest)
assert HEADER_BYTES == 64


@dataclass
class RebuildReport:
    indexed: list[int] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)   # (file name, reason)
    removed_temporaries: list[str] = field(default_factory=list)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    if t.is_cuda or not t.is_contiguous():
        raise ValueError("disk I/O needs a contiguous host tensor")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class DiskTier:
    tier = "disk"

    def __init__(self, directory: str | os.PathLike, layout: KVLayout, capacity_bytes: int | None = None,
                 fsync: bool = True):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.fsync = fsync
        self._digest = layout.digest()
        self._index: dict[int, int] = {}          # block_id -> checksum (published files)
        self._reserved: dict[int, int | None] = {}  # block_id -> checksum once written (temporary)
        self.report = RebuildReport()
        if capacity_bytes is None:
            # Measured once at start: the files already ours plus what the filesystem has free.
            ours = sum(1 for n in os.listdir(self.directory) if n.startswith("block-") and n.endswith(".kv"))
            capacity_bytes = ours * self.block_bytes + shutil.disk_usage(self.directory).free
        self._capacity = int(capacity_bytes)

    # ------------------------------------------------------------ paths
    def path_of(self, block_id: int) -> str:
        return os.path.join(self.directory, f"block-{block_id}.kv")

    def _tmp_path(self, block_id: int) -> str:
        return os.path.join(self.directory, f".block-{block_id}.kv.tmp")

    # ------------------------------------------------------------ queries
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return (len(self._index) + len(self._reserved)) * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def has(self, block_id: int) -> bool:
        return block_id in self._index

    def holds(self, block_id: int) -> bool:
        return block_id in self._index or block_id in self._reserved

    def not_ready(self, block_ids: Iterable[int]) -> list[int]:
        idx = self._index
        return [b for b in block_ids if b not in idx]

    def held(self, block_ids: Iterable[int]) -> list[int]:
        idx, res = self._index, self._reserved
        return [b for b in block_ids if b in idx or b in res]

    def blocks(self) -> list[int]:
        return sorted(self._index)

    def checksum_of(self, block_id: int) -> int:
        try:
            return self._index[block_id]
        except KeyError:
            raise NotResident("disk", [block_id]) from None

    def room_for(self, n: int) -> NoRoom | None:
        asked = n * self.block_bytes
        if asked > self.free_bytes:
            return NoRoom("disk", asked, self.free_bytes,
                          f"capacity {self.capacity_bytes} - used {self.used_bytes}")
        return None

    # ------------------------------------------------------------ writes
    def reserve(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        present = [b for b in ids if self.holds(b)]
        if present or len(set(ids)) != len(ids):
            raise AlreadyResident("disk", present or ids)
        refused = self.room_for(len(ids))
        if refused is not None:
            raise refused
        for b in ids:
            self._reserved[b] = None

    def write(self, block_id: int, payload: torch.Tensor, checksum: int) -> int:
        """Write a reserved block's bytes to its temporary file; returns payload bytes written."""
        if block_id not in self._reserved:
            raise NotResident("disk", [block_id])
        data = _as_bytes(payload)
        if len(data) != self.block_bytes:
            raise IntegrityError(f"disk: block {block_id} payload is {len(data)} bytes, expected {self.block_bytes}")
        head = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, 0, block_id, self.block_bytes, checksum, self._digest, 0)
        head = head[:56] + struct.pack("<I", zlib.crc32(head[:56])) + head[60:]
        written = 0
        # 0600: KV bytes are the prompts of whoever was served; no other user may read them
        fd = os.open(self._tmp_path(block_id), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "wb", buffering=0) as f:
            _write_all(f, head)
            written = _write_all(f, data)
            if self.fsync:
                os.fsync(f.fileno())
        self._reserved[block_id] = int(checksum)
        return written

    def publish(self, block_ids: Iterable[int]) -> None:
        """Rename written temporaries into place and index them."""
        ids = list(block_ids)
        unwritten = [b for b in ids if self._reserved.get(b, None) is None]
        if unwritten:
            raise NotResident("disk", unwritten)
        for b in ids:
            os.replace(self._tmp_path(b), self.path_of(b))
            self._index[b] = self._reserved.pop(b)
        if self.fsync:
            _fsync_dir(self.directory)

    def cancel(self, block_ids: Iterable[int]) -> None:
        """Drop reservations and any temporaries written for them."""
        for b in list(block_ids):
            if self._reserved.pop(b, "absent") != "absent":
                _unlink_quiet(self._tmp_path(b))

    def free(self, block_ids: Iterable[int]) -> int:
        """Delete published files; returns payload bytes freed. All-or-nothing on NotResident."""
        ids = list(block_ids)
        missing = [b for b in ids if b not in self._index]
        if missing or len(set(ids)) != len(ids):
            raise NotResident("disk", missing or ids)
        freed = 0
        for b in ids:
            _unlink_quiet(self.path_of(b))
            del self._index[b]
            freed += self.block_bytes
        return freed

    def forget(self, block_id: int) -> None:
        """Drop an index entry whose file is gone or unreadable (the bytes are already lost)."""
        self._index.pop(block_id, None)

    # ------------------------------------------------------------ reads
    def read_into(self, block_id: int, out: torch.Tensor) -> tuple[int, int]:
        """Read a block's payload into ``out`` (a contiguous host tensor of block_bytes, e.g. pinned).

        Returns (payload bytes read, checksum recorded in the header). Raises DiskCopyError naming
        the block when the file is missing, truncated, too long, or its header does not match.
        """
        path = self.path_of(block_id)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise DiskCopyError(block_id, path, "is missing") from None
        with f:
            head = f.read(HEADER_BYTES)
            checksum = self._check_header(block_id, path, head)
            data = _as_bytes(out)
            got = _read_all(f, data)
            if got != self.block_bytes:
                raise DiskCopyError(block_id, path, f"is truncated: {got} of {self.block_bytes} payload bytes")
            extra = len(f.read(1))
            if extra:
                raise DiskCopyError(block_id, path, f"is longer than header + {self.block_bytes} bytes")
        return got, checksum

    def read_span_into(self, block_id: int, out: torch.Tensor, offset_bytes: int, header: bool = False) -> int | None:
        """Read ``out``'s size in payload bytes of a block, from ``offset_bytes`` on, into ``out`` (a
        contiguous host tensor): one band of layers, for a restore that lands layer by layer
        (dataplane/moves/layered_disk.py). The file's size is checked on every read; with
        ``header`` its header too, as ``read_into`` checks it, and the header's checksum is
        returned (else None). Raises DiskCopyError naming the block, as ``read_into`` does."""
        path = self.path_of(block_id)
        data = _as_bytes(out)
        if offset_bytes < 0 or offset_bytes + len(data) > self.block_bytes:
            raise ValueError(f"bytes [{offset_bytes}, {offset_bytes + len(data)}) are outside a block of "
                             f"{self.block_bytes}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DiskCopyError(block_id, path, "is missing") from None
        try:
            checksum = self._check_header(block_id, path, os.pread(fd, HEADER_BYTES, 0)) if header else None
            size = os.fstat(fd).st_size - HEADER_BYTES
            if size < self.block_bytes:
                raise DiskCopyError(block_id, path, f"is truncated: {max(0, size)} of {self.block_bytes} payload bytes")
            if size > self.block_bytes:
                raise DiskCopyError(block_id, path, f"is longer than header + {self.block_bytes} bytes")
            done = 0
            while done < len(data):
                n = os.preadv(fd, [data[done:]], HEADER_BYTES + offset_bytes + done)
                if not n:
                    raise DiskCopyError(block_id, path, f"is truncated: {offset_bytes + done} of {self.block_bytes} "
                                                        "payload bytes read")
                done += n
        finally:
            os.close(fd)
        return checksum

    def _check_header(self, block_id: int | None, path: str, head: bytes) -> int:
        bid = -1 if block_id is None else block_id
        if len(head) < HEADER_BYTES:
            raise DiskCopyError(bid, path, f"is truncated: header {len(head)} of {HEADER_BYTES} bytes")
        magic, version, hbytes, _z, fid, fbytes, checksum, digest, crc = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or hbytes != HEADER_BYTES:
            raise DiskCopyError(bid, path, f"has a bad header (magic {magic!r}, version {version})")
        if zlib.crc32(head[:56]) != crc:
            raise DiskCopyError(bid, path, "has a damaged header (crc32 mismatch)")
        if block_id is not None and fid != block_id:
            raise DiskCopyError(block_id, path, f"holds block {fid}")
        if fbytes != self.block_bytes or digest != self._digest:
            raise DiskCopyError(bid, path, f"has another layout ({fbytes} bytes/block)")
        return checksum

    # ------------------------------------------------------------ restart
    def rebuild(self, verify: Callable[[int, torch.Tensor], int] | None = None) -> RebuildReport:
        """Rebuild the index from the files. ``verify(block_id, words) -> psum64`` re-hashes payloads.

        Files that fail (bad header, wrong size, checksum mismatch) move to ``quarantine/``.
        """
        self._index.clear()
        report = RebuildReport()
        buf = torch.empty(self.layout.block_words, dtype=torch.int32)
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                continue
            if name.startswith(".") and name.endswith(".tmp"):
                _unlink_quiet(path)
                report.removed_temporaries.append(name)
                continue
            if not (name.startswith("block-") and name.endswith(".kv")):
                continue
            try:
                bid = int(name[len("block-"):-len(".kv")])
                _, checksum = self.read_into(bid, buf)
                if verify is not None:
                    got = int(verify(bid, buf))
                    if got != checksum:
                        raise DiskCopyError(bid, path, f"fails its checksum: header {checksum:#018x}, payload {got:#018x}")
            except (DiskCopyError, ValueError) as e:
                report.quarantined.append((name, str(e)))
                qdir = os.path.join(self.directory, "quarantine")
                os.makedirs(qdir, mode=0o700, exist_ok=True)
                os.replace(path, os.path.join(qdir, f"{time.time_ns()}-{name}"))
                continue
            self._index[bid] = checksum
            report.indexed.append(bid)
        self._trim_quarantine()
        self.report = report
        return report

    def _trim_quarantine(self) -> None:
        """Keep the newest ``QUARANTINE_KEEP`` quarantined files (named by when they were moved
        there) for inspection; older ones are deleted, so restarts that keep failing the same way
        (another model's files) do not fill the disk."""
        qdir = os.path.join(self.directory, "quarantine")
        if not os.path.isdir(qdir):
            return
        names = sorted(os.listdir(qdir), key=lambda n: (len(n.split("-", 1)[0]), n))
        for name in names[:-QUARANTINE_KEEP] if len(names) > QUARANTINE_KEEP else []:
            _unlink_quiet(os.path.join(qdir, name))

    def check_integrity(self) -> None:
        """Bookkeeping invariants. Damage to the files themselves is external: moves and
        ``rebuild`` report it per block, ``audit_files`` lists it."""
        if self.used_bytes > self.capacity_bytes:
            raise IntegrityError(f"disk: used {self.used_bytes} > capacity {self.capacity_bytes}")
        both = set(self._index) & set(self._reserved)
        if both:
            raise IntegrityError(f"disk: blocks both indexed and reserved: {sorted(both)[:16]}")

    def audit_files(self) -> list[tuple[int, int]]:
        """(block_id, file size) of indexed files whose size is not header + block_bytes (-1: missing)."""
        want = HEADER_BYTES + self.block_bytes
        bad = []
        for b in sorted(self._index):
            try:
                size = os.path.getsize(self.path_of(b))
            except OSError:
                size = -1
            if size != want:
                bad.append((b, size))
        return bad


def _write_all(f, data) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = f.write(view[done:])
        if not n:
            raise OSError(f"short write: {done} of {len(view)} bytes")
        done += n
    return done


def _read_all(f, view: memoryview) -> int:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker_disk_dir(run_dir: str | os.PathLike, worker: int, keep: bool) -> Path:
    """A worker process's disk tier directory: emptied for a new incarnation unless ``keep`` (the
    worker's ``--keep-disk``: the mover then rebuilds its index from the files, verifying each,
    and the worker's Hello offers them to the control, whose ClaimDisk says which to keep)."""
    path = Path(run_dir) / f"disk-{worker}"
    if not keep:
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path
