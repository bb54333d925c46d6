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


class RestoreByLayer(InFlight):
    route = ("host", "device")

    # ------------------------------------------------------------ begin: claim, then copy by layer
    def begin(self) -> None:
        c, s = self.ctx, self.ctx.streams
        ids = self.ids
        hslots = c.host.slots_of(ids)
        order = sorted(range(len(ids)), key=hslots.__getitem__)     # host-slot order: long runs
        self.order_ids = [ids[i] for i in order]
        src = [hslots[i] for i in order]
        self.claimed = c.device.table.claim(len(ids))
        c.device.table.record_reserved(self.order_ids, self.claimed)
        self.dslots, self.claimed = self.claimed, None
        self.slot_by_block = dict(zip(self.order_ids, self.dslots))
        self.expected = c.host.checksums_of(ids)
        self.expected_walk = [self.expected[i] for i in order]
        self.bytes_moved = len(ids) * c.layout.block_bytes
        runs = coalesce(src, self.dslots)
        L = c.layout.num_layers
        width = c.layout.block_words // L
        self.cols = [(layer * width, (layer + 1) * width) for layer in range(L)]
        self.error: BaseException | None = None
        self.mark("reserved")
        self.landed_ns: int | None = None
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
            self.copier = None
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

    # ------------------------------------------------------------ what a reader joins
    def landing(self) -> tuple[list, dict[int, int]]:
        """(per layer, the wait for that layer's bytes; block -> the slot it is landing in)."""
        return list(self.gates), dict(self.slot_by_block)

    def device_done(self) -> bool:
        if self.ctx.streams.cuda:
            return self.hashed.query()
        return self._landed.is_set()

    # ------------------------------------------------------------ finish: verify, then commit
    def finish(self):
        c, s = self.ctx, self.ctx.streams
        if self.copier is not None:
            self.copier.join()
            if self.error is not None:
                raise self.error
            self.hasher = Hasher(c, c.device.words, self.dslots, self.order_ids)
            self.hasher.enqueue(0, len(self.ids))
            self.hashed = self.hasher.done()
        walked = self.hasher.values()            # waits for the last layer and its hashing
        self.mark("landed")
        if walked != self.expected_walk:
            back = {b: k for k, b in enumerate(self.order_ids)}
            bad = [(b, e, walked[back[b]]) for b, e in zip(self.ids, self.expected) if walked[back[b]] != e]
            self.rollback()
            return self.failed(str(ChecksumMismatch("restore host->device (by layer)", bad)))
        c.device.publish(self.ids)               # raises, naming what is wrong
        self.dslots = None
        s.wait_event(self.compute, self.hashed)  # no compute kernel reads a page before it landed
        ack = self.acked(self.free_source(), self.expected)
        # NOTE: finished when the bytes landed and were hashed, not when this was called: a kept
        # move is finished after the prefill that read it, and the control learns the link's
        # bandwidth from these two times (CostModel.observe_transfer)
        if s.cuda:
            self.timing[1].synchronize()
            self.landed_ns = self.started_ns + int(self.timing[0].elapsed_time(self.timing[1]) * 1e6)
        if self.landed_ns is not None and self.landed_ns < ack.finished_ns:
            ack = msgspec.structs.replace(ack, finished_ns=max(self.landed_ns, self.started_ns))
        return ack

    def drain(self) -> None:
        if getattr(self, "copier", None) is not None:
            self.copier.join()
        super().drain()

    def rollback(self) -> None:
        if getattr(self, "claimed", None) is not None:
            self.ctx.device.table.unclaim(self.claimed)
            self.claimed = None
        if getattr(self, "dslots", None) is not None:
            self.ctx.device.cancel(self.ids)
            self.dslots = None


__all__ = ["RestoreByLayer"]
