"""CUDA graphs of the pure-decode step: one replay instead of ~15 launches per layer.

A decode step of a small model is launch-bound (SmolLM2: ~400 kernels of a few µs each); a graph
replays them without the Python and driver cost per launch. Graphs are captured per batch size
(padded up to the next captured size) over static input buffers and ONE pool:

    dev (int32):  rows 0..4 = token, position, slot, offset, context_len   [5, max_batch]
                  then block tables                                         [max_batch, max_blocks]
Each step fills a pinned host twin with numpy, copies it in one transfer, and replays.
Padding rows decode a dummy token into ``scratch_slot`` (a pool block the caller reserves).

NOTE: a graph holds the pool's address. After a rebind (a new pool generation) the graphs must
be recaptured: ``step`` refuses a pool other than the one captured.
"""
from __future__ import annotations

import numpy as np
import torch

from residency.dataplane.model.errors import BatchError
from residency.dataplane.model.runner import ModelRunner, StepPlan


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, kv_pool: torch.Tensor, *, max_blocks_per_seq: int,
                 scratch_slot: int, batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)):
        if runner.device.type != "cuda":
            raise BatchError("CUDA graphs need a runner on a CUDA device")
        runner.check_pool(kv_pool)
        self.runner, self.pool = runner, kv_pool
        self.page = kv_pool.shape[3]
        self.sizes = tuple(sorted(batch_sizes))
        self.max_batch, self.max_blocks = self.sizes[-1], max_blocks_per_seq
        self.scratch = scratch_slot
        n = 5 * self.max_batch + self.max_batch * self.max_blocks
        self.host = torch.zeros(n, dtype=torch.int32).pin_memory()
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(n, dtype=torch.int32, device=runner.device)
        self._reset_host()
        self.dev.copy_(self.host)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied = torch.cuda.Event()                  # the host twin may be rewritten after this
        self.mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):                     # largest first: the pool is reused
            self._capture(bs)

    # ------------------------------------------------------------ a reader of the pool (pools/readers.py)
    name = "graphs"
    gen = -1

    def bind(self, pool, gen: int) -> None:
        """Carry ``pool`` at ``gen`` only if it is the very tensor captured (a rebind in place);
        any other pool is refused (ReaderRefused): the graphs would write through a stale address."""
        from residency.dataplane.pools.errors import ReaderRefused  # noqa: PLC0415 - model/ stays free of pools/ at import

        t = pool.tensor
        if t.data_ptr() != self.pool.data_ptr() or tuple(t.shape) != tuple(self.pool.shape):
            raise ReaderRefused(self.name, f"captured on a pool of {tuple(self.pool.shape)} at {self.pool.data_ptr():#x}, "
                                f"offered {tuple(t.shape)} at {t.data_ptr():#x}; recapture after a rebind")
        self.gen = gen
        pool.stamp(self.name, gen)

    def _views(self, bs: int) -> StepPlan:
        rows = self.dev[: 5 * self.max_batch].view(5, self.max_batch)
        bt = self.dev[5 * self.max_batch:].view(self.max_batch, self.max_blocks)
        return StepPlan(tokens=rows[0, :bs], positions=rows[1, :bs], slots=rows[2, :bs], offsets=rows[3, :bs],
                        last_rows=None, all_decode=True, dec_block_tables=bt[:bs], dec_context_lens=rows[4, :bs])

    def _reset_host(self) -> None:
        h = self.host_np
        rows = h[: 5 * self.max_batch].reshape(5, self.max_batch)
        rows[:] = 0
        rows[2] = self.scratch
        rows[4] = 1
        h[5 * self.max_batch:] = self.scratch

    def _capture(self, bs: int) -> None:
        plan = self._views(bs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                              # compile kernels, create handles
                self.runner.run(plan, self.pool)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.mempool):
            out = self.runner.run(plan, self.pool)
        self.graphs[bs] = (g, out)

    def step(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
             kv_pool: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token for each of n sequences; returns logits [n, vocab] (a view into the
        graph's output: consume it before the next step)."""
        if kv_pool is not None and kv_pool.data_ptr() != self.pool.data_ptr():
            raise BatchError("this pool is not the one the graphs were captured on; recapture after a rebind")
        n = len(tokens)
        bs = next((s for s in self.sizes if s >= n), None)
        if bs is None or n == 0:
            raise BatchError(f"{n} sequences; captured batch sizes are {self.sizes}")
        if block_tables.shape[1] > self.max_blocks:
            raise BatchError(f"block tables of {block_tables.shape[1]} slots exceed the captured {self.max_blocks}")
        if int(positions.max()) + 1 > block_tables.shape[1] * self.page:
            raise BatchError("a position lies past its block table")
        self._copied.synchronize()                          # the last step's copy has read the host twin
        self._reset_host()
        h = self.host_np
        rows = h[: 5 * self.max_batch].reshape(5, self.max_batch)
        bt = h[5 * self.max_batch:].reshape(self.max_batch, self.max_blocks)
        pos = positions.astype(np.int64)
        rows[0, :n] = tokens
        rows[1, :n] = pos
        rows[2, :n] = block_tables[np.arange(n), pos // self.page]
        rows[3, :n] = pos % self.page
        rows[4, :n] = pos + 1
        bt[:n, : block_tables.shape[1]] = block_tables
        self.dev.copy_(self.host, non_blocking=True)
        self._copied.record()
        g, out = self.graphs[bs]
        g.replay()
        return out[:n]
