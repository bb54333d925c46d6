"""A restore (host -> device) that lands layer by layer, so a prefill can start before it is whole.

A KV block is block-first: one row of the pool holds every layer of its page, layer after layer.
A plain restore (``RestoreFromHost``) copies whole rows, so layer 0 of the last block lands with
the last bytes. This one copies layer 0 of every block first, then layer 1, and so on, and says
when each layer is in (``gates``): a returning turn's forward waits before layer l only for
layer l of its history (``ModelRunner.forward(layer_ready=...)``), and computes the layers
before it meanwhile.

    rows (blocks) ──►   layer 0 │ layer 1 │ ... │ layer L-1
    h2d stream:    copy col 0 of every run ─► gate 0   copy col 1 ─► gate 1   ...   ─► gate L-1
    hash stream:                                                    (wait gate L-1) psum64 ─► hashed
    CPU:           a copier thread does the same copies in the same order, setting a
                   ``threading.Event`` per layer (so the overlap is real on a CPU worker too)

A run is a stretch of blocks consecutive on both sides (blocks walked in host-slot order, so runs
are long); each layer of a run is one 2-D copy (``copy_runs_cols``: n rows of one layer's bytes,
a row apart on both sides).

Verification is unchanged: nothing is published before every checksum matched (``finish``). A
reader that joined the gates read bytes that were not yet verified: the serving loop sends none of
what it computed from them before this move's outcome is known, and fails the request if it failed
(dataplane/restore_pipeline.py).
"""
from __future__ import annotations

import threading

import msgspec

from residency.dataplane.moves.base import Hasher, InFlight
from residency.dataplane.moves.copy import coalesce
from residency.dataplane.pools.errors import ChecksumMismatch


class LandsByLayer(InFlight):
    """What every restore that lands layer by layer shares: claimed device slots, one gate per
    layer, the landing a reader joins, and the verify-then-commit of ``finish`` (the routes:
    ``RestoreByLayer`` from the host, ``RestoreFromDiskByLayer`` from disk, moves/layered_disk.py)."""

    reserved_slots = "dslots"

    def claim_device(self, order_ids: list[int]) -> None:
        """Claim a device slot per block of ``order_ids`` (the walk order) and record them."""
        c = self.ctx
        self.order_ids = order_ids
        self.claimed = c.device.table.claim(len(order_ids))
        c.device.table.record_reserved(order_ids, self.claimed)
        self.dslots, self.claimed = self.claimed, None
        self.slot_by_block = dict(zip(order_ids, self.dslots))
        self.bytes_moved = len(order_ids) * c.layout.block_bytes
        self.error: BaseException | None = None
        self.landed_ns: int | None = None
        self.copier: threading.Thread | None = None

    # ------------------------------------------------------------ what a reader joins
    def landing(self) -> tuple[list, dict[int, int]]:
        """(per layer, the wait for that layer's bytes; block -> the slot it is landing in)."""
        return list(self.gates), dict(self.slot_by_block)

    # ------------------------------------------------------------ finish: verify, then commit
    def commit_verified(self, walked: list[int], expected_walk: list[int], expected: list[int], what: str):
        """Compare the landed pages' checksums (walk order) with what they should be; publish and
        ack, or roll back and fail naming the blocks. ``expected``: command order, for the ack."""
        c, s = self.ctx, self.ctx.streams
        self.mark("landed")
        if walked != expected_walk:
            got = dict(zip(self.order_ids, walked))
            bad = [(b, e, got[b]) for b, e in zip(self.ids, expected) if got[b] != e]
            self.rollback()
            return self.failed(str(ChecksumMismatch(what, bad)))
        c.device.publish(self.ids)               # raises, naming what is wrong
        self.dslots = None
        s.wait_event(self.compute, self.hashed)  # no compute kernel reads a page before it landed
        ack = self.acked(self.free_source(), expected)
        # NOTE: finished when the bytes landed and were hashed, not when this was called: a kept
        # move is finished after the prefill that read it, and the control learns the link's
        # bandwidth from these two times (CostModel.observe_transfer)
        if self.landed_ns is not None and self.landed_ns < ack.finished_ns:
            ack = msgspec.structs.replace(ack, finished_ns=max(self.landed_ns, self.started_ns))
        return ack

    def hash_landed(self) -> list[int]:
        """The checksums of the landed pages, walk order (the copies are all in: hashed here)."""
        c = self.ctx
        self.hasher = Hasher(c, c.device.words, self.dslots, self.order_ids)
        self.hasher.enqueue(0, len(self.ids), after=self.ctx.streams.mark(self.ctx.streams.h2d))
        self.hashed = self.hasher.done()
        return self.hasher.values()

    def drain(self) -> None:
        if getattr(self, "copier", None) is not None:
            self.copier.join()               # nothing writes the slots once they are given back
        super().drain()


class RestoreByLayer(LandsByLayer):
    route = ("host", "device")

    # ------------------------------------------------------------ begin: claim, then copy by layer
    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        ids = self.ids
        hslots = c.host.slots_of(ids)
        order = sorted(range(len(ids)), key=hslots.__getitem__)     # host-slot order: long runs
        src = [hslots[i] for i in order]
        self.claim_device([ids[i] for i in order])
        self.expected = c.host.checksums_of(ids)
        self.expected_walk = [self.expected[i] for i in order]
        runs = coalesce(src, self.dslots)
        L = c.layout.num_layers
        width = c.layout.block_words // L
        self.cols = [(layer * width, (layer + 1) * width) for layer in range(L)]
        self.mark("reserved")
        if s.cuda:
            import torch  # noqa: PLC0415

            # NOTE: the claimed slots may have been freed while kernels queued on the compute stream
            # still read their old contents: the copies wait for the compute stream first.
            self.after_compute(s.h2d)
            self.gates = []
            self.timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.timing[0].record(s.h2d)
            with s.on(s.h2d):
                for lo, hi in self.cols:
                    c.dma.copy_runs_cols(s.h2d, c.device.words, c.host.words, runs, lo, hi)
                    self.gates.append(s.mark(s.h2d))
            self.hasher = Hasher(c, c.device.words, self.dslots, self.order_ids)
            self.hasher.enqueue(0, len(ids), after=self.gates[-1])
            self.hashed = self.hasher.done()
            self.timing[1].record(s.hash)
        else:
            self.gates = [threading.Event() for _ in self.cols]
            self._landed = threading.Event()
            self.copier = threading.Thread(target=self._copy_on_cpu, args=(runs,), name="restore-by-layer",
                                           daemon=True)
            self.copier.start()
        self.mark("enqueued")

    def _copy_on_cpu(self, runs) -> None:
        """The copier thread: layer by layer, each gate set once its layer is in. Every gate is set
        even when a copy raises, so no reader waits forever (the move then fails in ``finish``)."""
        c = self.ctx
        try:
            for (lo, hi), gate in zip(self.cols, self.gates):
                c.dma.copy_runs_cols(None, c.device.words, c.host.words, runs, lo, hi)
                gate.set()
            self.landed_ns = c.clock()
        except BaseException as e:  # noqa: BLE001 - reported by finish
            self.error = e
        finally:
            for gate in self.gates:
                gate.set()
            self._landed.set()

    def device_done(self) -> bool:
        if self.ctx.streams.cuda:
            return self.hashed.query()
        return self._landed.is_set()

    def finish(self):
        if self.copier is not None:
            self.copier.join()
            if self.error is not None:
                raise self.error
            walked = self.hash_landed()
        else:
            walked = self.hasher.values()        # waits for the last layer and its hashing
            self.timing[1].synchronize()
            self.landed_ns = self.started_ns + int(self.timing[0].elapsed_time(self.timing[1]) * 1e6)
        return self.commit_verified(walked, self.expected_walk, self.expected, "restore host->device (by layer)")


__all__ = ["LandsByLayer", "RestoreByLayer"]
