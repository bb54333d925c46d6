"""A restore from disk that lands layer by layer, so a returning turn's prefill starts on it at once.

A disk file holds one block, block-first like the pool's row: every layer of the page, layer after
layer. A plain restore from disk (``RestoreFromDisk``) reads whole files, so layer 0 of the last
block is in only with the last bytes. This one reads a band of layers of every block first (an
``os.preadv`` of that band's span of each file, into the pinned staging ring), copies the band to
its columns of the claimed device rows, opens the gates of the band's layers, then reads the next
band. A reader joins the gates exactly as for a restore from the host (``LandsByLayer.landing``):
its forward waits before layer l only for layer l of the history.

    reader thread:  band 0: pread band 0 of files [0, h) ─► staging half 0 ─► h2d copy ─┐
                            pread band 0 of files [h, 2h) ─► staging half 1 ─► h2d copy ─┤ (a half is
                            ...                                                          │ refilled once
                    ─► gates of band 0's layers open                                      │ its copy is
                    band 1: ...                                                           │ done)
    finish:         join the reader; hash the device rows; compare with the files' headers
                    (each header checked against the index as it is read); publish, or roll back

The reader is a thread on both paths. On a GPU it enqueues the copies on the h2d stream (a half of
the ring is refilled once the copy out of it completed, so the disk read of one half overlaps the
copy of the other) and each gate is a host event (the band was read and its copies enqueued)
followed by a stream event (the copies landed): a forward waits on the host only for the disk. On
a CPU the copies run in the thread and the gates are ``threading.Event``s.

Why bands and not single layers: a layer of one block is a small read (a 2 MiB block of 32 layers
is 64 KiB a layer), and every band reopens every file. A band is at least ``disk_read_bytes`` of a
block and there are at most ``MAX_BANDS`` of them (``layer_bands``): a prefill waits for at most
1/MAX_BANDS of the history's bytes before its first layer runs, and the disk sees reads of a
useful size.

Verification is the plain restore's: nothing is published before every page's checksum matched
its file's header (and the header the index); a failed read, a header that changed since it was
indexed or a mismatch fails the move with nothing published and the claimed slots given back.
A reader that joined the gates read bytes not yet verified: the serving loop sends nothing computed
from them before the move's outcome is known (dataplane/restore_pipeline.py).
"""
from __future__ import annotations

import threading

from residency.dataplane.moves.base import DISK_READ_BYTES
from residency.dataplane.moves.copy import coalesce
from residency.dataplane.moves.layered import LandsByLayer
from residency.dataplane.pools.errors import DiskCopyError

# The most bands a restore is cut into (each band reads at least ``MoveContext.disk_read_bytes``,
# DISK_READ_BYTES unless a test asks for less, of a block).
MAX_BANDS = 8


def layer_bands(num_layers: int, layer_bytes: int, min_read_bytes: int = DISK_READ_BYTES,
                max_bands: int = MAX_BANDS) -> list[tuple[int, int]]:
    """[first layer, end layer) of each band: consecutive, covering every layer once, each at least
    ``min_read_bytes`` of a block (the last band may be shorter) and no more than ``max_bands``.

        32 layers of 64 KiB, 256 KiB reads, 8 bands at most:  [0,4) [4,8) ... [28,32)
    """
    if num_layers < 1 or layer_bytes < 1 or max_bands < 1:
        raise ValueError(f"layer_bands({num_layers}, {layer_bytes}, max_bands={max_bands}): all must be >= 1")
    per = max(-(-num_layers // max_bands), -(-max(1, min_read_bytes) // layer_bytes), 1)
    return [(lo, min(num_layers, lo + per)) for lo in range(0, num_layers, per)]


class ReadThenCopied:
    """Layer l's gate of a restore from disk on a GPU: the reader thread sets ``read`` once the
    layer's band is read and its copies are enqueued, with ``copied`` the stream event after them.
    ``wait`` blocks the host for the read, then makes the current stream wait for the copies."""

    on_cuda = True

    def __init__(self):
        self.read = threading.Event()
        self.copied = None

    def wait(self) -> None:
        self.read.wait()
        if self.copied is not None:
            self.copied.wait()

    def query(self) -> bool:
        return self.read.is_set() and (self.copied is None or self.copied.query())


class RestoreFromDiskByLayer(LandsByLayer):
    route = ("disk", "device")

    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        self.indexed = [c.disk.checksum_of(b) for b in self.ids]     # raises NotResident, naming them
        self.claim_device(list(self.ids))
        L = c.layout.num_layers
        width = c.layout.block_words // L
        self.bands = layer_bands(L, width * 4, c.disk_read_bytes)
        self.mark("reserved")
        self.timing = None
        if s.cuda:
            import torch  # noqa: PLC0415

            self.after_compute(s.h2d)    # see RestoreFromHost: old readers of the claimed slots
            self.gates = [ReadThenCopied() for _ in range(L)]
            self.timing = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self.timing[0].record(s.h2d)
        else:
            self.gates = [threading.Event() for _ in range(L)]
        self.headers: list[int | None] = [None] * len(self.ids)
        self._landed = threading.Event()
        self.last_copy = None
        self.copier = threading.Thread(target=self._read_bands, name="restore-from-disk-by-layer", daemon=True)
        self.copier.start()
        self.mark("enqueued")

    # ------------------------------------------------------------ the reader thread
    def _read_bands(self) -> None:
        """Band by band: read it from every file, copy it to the claimed rows, open its gates. Every
        gate is opened even when a read fails, so no reader waits forever (``finish`` fails the move)."""
        c, s = self.ctx, self.ctx.streams
        ring = c.ring
        try:
            if s.cuda:
                import torch  # noqa: PLC0415

                torch.cuda.set_device(s.device)
            with ring.lock:
                for k in range(ring.num_slots):          # whatever used the rows before is done with them
                    ring.acquire(k)
                try:
                    self._bands_through(ring.rows.view(-1))
                    if self.timing is not None:
                        self.timing[1].record(s.h2d)     # when the last band's copies landed
                finally:
                    for k in range(ring.num_slots):      # busy until this move's last copy completed
                        ring.release_after(k, s.h2d)
            self.landed_ns = c.clock()
        except BaseException as e:  # noqa: BLE001 - reported by finish
            self.error = e
        finally:
            self._open_all()
            self._landed.set()

    def _bands_through(self, flat) -> None:
        c, s = self.ctx, self.ctx.streams
        n, L = len(self.ids), c.layout.num_layers
        width = c.layout.block_words // L
        free = [None, None]                     # per staging half: the copy out of it (None: none yet)
        turn = 0
        for band, (first, end) in enumerate(self.bands):
            lo, hi = first * width, end * width
            span = hi - lo
            half = max(1, flat.numel() // span // 2)
            for start in range(0, n, half):
                stop = min(n, start + half)
                if free[turn] is not None:
                    free[turn].synchronize()    # the copy out of this half has completed
                rows = flat[turn * half * span:(turn * half + stop - start) * span].view(stop - start, span)
                for i in range(start, stop):
                    got = c.disk.read_span_into(self.ids[i], rows[i - start], lo * 4, header=band == 0)
                    if band == 0:
                        self._check_indexed(i, got)
                runs = coalesce(range(stop - start), self.dslots[start:stop])
                with s.on(s.h2d):
                    c.dma.copy_rows_to_cols(s.h2d, c.device.words, rows, runs, lo)
                free[turn] = s.mark(s.h2d)
                turn ^= 1
            self.last_copy = s.mark(s.h2d)
            for layer in range(first, end):
                self._open(layer, self.last_copy)

    def _check_indexed(self, i: int, header: int) -> None:
        b = self.ids[i]
        if header != self.indexed[i]:
            raise DiskCopyError(b, self.ctx.disk.path_of(b), f"changed since it was indexed: header {header:#018x}, "
                                                             f"index {self.indexed[i]:#018x}")
        self.headers[i] = header

    def _open(self, layer: int, copied) -> None:
        gate = self.gates[layer]
        if isinstance(gate, ReadThenCopied):
            gate.copied = copied if gate.copied is None else gate.copied
            gate.read.set()
        else:
            gate.set()

    def _open_all(self) -> None:
        after = self.ctx.streams.mark(self.ctx.streams.h2d) if self.ctx.streams.cuda else None
        for layer in range(len(self.gates)):
            self._open(layer, after)

    # ------------------------------------------------------------ the mover's side
    def device_done(self) -> bool:
        return self._landed.is_set() and (self.last_copy is None or self.last_copy.query())

    def finish(self):
        self.copier.join()
        if self.error is not None:
            e = self.error
            if isinstance(e, DiskCopyError) and e.reason == "is missing":
                self.ctx.disk.forget(e.block_id)     # its bytes are gone (as RestoreFromDisk does)
            self.abort()
            return self.failed(str(e) if isinstance(e, DiskCopyError) else f"{type(e).__name__}: {e}")
        walked = self.hash_landed()
        if self.timing is not None:
            self.timing[1].synchronize()
            self.landed_ns = self.started_ns + int(self.timing[0].elapsed_time(self.timing[1]) * 1e6)
        return self.commit_verified(walked, self.headers, self.headers, "restore disk->device (by layer)")


__all__ = ["DISK_READ_BYTES", "MAX_BANDS", "ReadThenCopied", "RestoreFromDiskByLayer", "layer_bands"]
