"""CUDA graphs in the serving loop: which steps replay a captured decode, and the graphs themselves.

    decode_path(...)          pure: "graph" or "eager" for one step, with the reason
    StepGraphs.capture(...)   at worker start: one graph per batch size up to max_seqs (1, 2, 4 …),
                              the memory they hold measured and logged
    StepGraphs.forward(...)   the step's logits through the path decode_path chose

A graph replays the whole decode step of a fixed batch size over static buffers; a step of n
sequences runs on the smallest captured size ≥ n, its padding rows writing no K/V. It cannot
serve a step with a prefill chunk (its rows are one token per sequence), a batch larger than its
largest size, block tables wider than it was captured for, or a pool other than the one it holds
the address of (after a rebind the graphs must be captured again). Those steps run eagerly, and
the choice is the same function on CPU and GPU: on CPU it answers "eager: no CUDA".

Sampling stays outside the graph (it reads the logits the step returns), so every sampling
setting runs on either path.

NOTE: a graph holds the device pool's address: it is a reader of the pool, and a pool moved to a
new generation makes ``decode_path`` answer eager until the graphs are captured again.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from residency.dataplane.model.runner import ModelRunner, SeqInput

log = structlog.get_logger("dataplane.serving_graphs")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Block tables of a graph cover at most this many positions. The decode kernel launches its
# programs for the captured width (splits past a sequence's context return at once), so a graph
# captured for a 128k-token window would launch ~16x the programs of one for 8k on every step; a
# longer context than this decodes eagerly instead (decode_path says "block table of ... pages").
GRAPH_MAX_TOKENS = 16384


@dataclass(frozen=True)
class DecodePath:
    path: str                 # "graph" | "eager"
    why: str
    batch_size: int = 0       # the captured size a graph step runs on (0: eager)


def decode_path(*, on_cuda: bool, sizes: Sequence[int], new_tokens: Sequence[int], table_widths: Sequence[int],
                max_blocks: int, pool_current: bool, batch_invariant: bool = False,
                layers_landing: bool = False) -> DecodePath:
    """Which path one step takes. Pure: the step's shape and what was captured in, the choice out.

    ``new_tokens[i]``: new tokens of sequence i this step; ``table_widths[i]``: pages its block
    table covers; ``sizes``: captured batch sizes (empty: none captured); ``max_blocks``: table
    width they were captured for; ``pool_current``: the pool is the one they were captured on;
    ``layers_landing``: a restore is still landing pages the step reads (its layers wait in turn).
    """
    n = len(new_tokens)
    if not on_cuda:
        return DecodePath("eager", "no CUDA")
    if not sizes:
        return DecodePath("eager", "no graphs captured")
    if batch_invariant:
        return DecodePath("eager", "a batch-invariant runner has no graph")
    if n == 0:
        return DecodePath("eager", "empty step")
    longer = sum(1 for t in new_tokens if t != 1)
    if longer:
        return DecodePath("eager", f"prefill: {longer} of {n} sequences take more than one token")
    if layers_landing:
        return DecodePath("eager", "pages still landing layer by layer")
    largest = max(sizes)
    if n > largest:
        return DecodePath("eager", f"batch {n} > largest graph {largest}")
    widest = max(table_widths)
    if widest > max_blocks:
        return DecodePath("eager", f"block table of {widest} pages > the {max_blocks} captured")
    if not pool_current:
        return DecodePath("eager", "the pool moved to another generation since capture")
    bs = min(s for s in sizes if s >= n)
    return DecodePath("graph", f"batch {n} padded to {bs}", bs)


def graph_sizes_for(max_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_seqs``, and ``max_seqs`` itself: every batch pads up to one."""
    sizes = [s for s in GRAPH_BATCH_SIZES if s < max_seqs]
    return tuple(sizes + [max_seqs]) if max_seqs >= 1 else ()


def graph_table_width(max_positions: int, page_tokens: int) -> int:
    """Pages a captured block table covers: the model's window, at most ``GRAPH_MAX_TOKENS``."""
    return -(-min(max_positions, GRAPH_MAX_TOKENS) // page_tokens)


class StepGraphs:
    """The serving loop's forward: through a captured decode graph where ``decode_path`` says so,
    eagerly otherwise. Counts the steps of each path (``num_steps``)."""

    def __init__(self, runner: ModelRunner, graphs=None, *, graph_bytes: int | None = None):
        self.runner = runner
        self.graphs = graphs                      # DecodeGraphs, or None (CPU, or capture refused)
        self.graph_bytes = graph_bytes            # memory the capture took; None: nothing captured/measured
        self.num_steps = {"graph": 0, "eager": 0}
        self.last: DecodePath | None = None
        self.books = None                         # MemoryBooks told of every capture and drop, once set

    def _now_holds(self, graphs, graph_bytes: int | None) -> None:
        """The one place the graphs change after start: the worker's memory books follow, so the
        memory view says what the current capture took, not the first one's figure."""
        self.graphs, self.graph_bytes = graphs, graph_bytes
        if self.books is not None:
            self.books.set_graphs(graph_bytes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.graphs.sizes if self.graphs is not None else ()

    @property
    def max_blocks(self) -> int:
        return self.graphs.max_blocks if self.graphs is not None else 0

    @classmethod
    def capture(cls, runner: ModelRunner, kv_pool: torch.Tensor, *, max_seqs: int, max_blocks_per_seq: int
                ) -> StepGraphs:
        """Capture a graph per size of ``graph_sizes_for(max_seqs)`` over ``kv_pool`` (after the
        kernels are warm: each size runs twice eagerly first). Off CUDA: no graphs, every step eager."""
        if runner.device.type != "cuda" or runner.batch_invariant:
            return cls(runner)
        from residency.dataplane.model.graphs import DecodeGraphs  # noqa: PLC0415 - CUDA only

        sizes = graph_sizes_for(max_seqs)
        torch.cuda.synchronize(runner.device)
        before = torch.cuda.memory_reserved(runner.device)
        t0 = time.perf_counter()
        graphs = DecodeGraphs(runner, kv_pool, max_blocks_per_seq=max_blocks_per_seq, scratch_slot=-1,
                              batch_sizes=sizes)
        torch.cuda.synchronize(runner.device)
        graph_bytes = torch.cuda.memory_reserved(runner.device) - before
        log.info("decode_graphs_captured", sizes=list(sizes), max_blocks_per_seq=max_blocks_per_seq,
                 graph_bytes=graph_bytes, seconds=round(time.perf_counter() - t0, 2))
        return cls(runner, graphs, graph_bytes=graph_bytes)

    # ------------------------------------------------------------ a reader of the device pool
    name = "graphs"
    gen = -1

    def bind(self, pool, gen: int) -> None:
        """Carry ``pool`` at ``gen``. The same tensor (a rebind in place): nothing to do. Another
        tensor: the graphs are captured again on it; if that capture fails they are dropped and
        every step runs eagerly. Either way no graph keeps the old pool's address, so this
        reader always stamps."""
        t = pool.tensor
        old = self.graphs
        if old is not None and (t.data_ptr() != old.pool.data_ptr() or tuple(t.shape) != tuple(old.pool.shape)):
            self.graphs, self.graph_bytes = None, None         # the old pool's address is gone first
            sizes, width = old.sizes, old.max_blocks
            del old
            try:
                fresh = StepGraphs.capture(self.runner, t, max_seqs=max(sizes), max_blocks_per_seq=width)
                self._now_holds(fresh.graphs, fresh.graph_bytes)
            except Exception as e:  # noqa: BLE001 - no graphs is a slower path, not a torn pool
                log.warning("decode_graphs_dropped", gen=gen, error=repr(e))
                self._now_holds(None, None)
        self.gen = gen
        pool.stamp(self.name, gen)

    # ------------------------------------------------------------ a reader of the weights arena
    def drop(self) -> None:
        """Let the graphs go (the weights they read are leaving the device): every step eager
        until ``use_runner`` captures again."""
        self._now_holds(None, None)

    def use_runner(self, runner: ModelRunner, kv_pool: torch.Tensor, *, max_seqs: int, max_blocks_per_seq: int,
                   capture: bool) -> None:
        """Run ``runner`` from now on (a flip or a wake: other weights, or the same at another
        address); with ``capture``, its decode graphs are captured again over ``kv_pool`` (a
        failed capture leaves every step eager, logged: slower, never wrong)."""
        self.drop()
        self.runner = runner
        if not capture:
            return
        try:
            fresh = StepGraphs.capture(runner, kv_pool, max_seqs=max_seqs, max_blocks_per_seq=max_blocks_per_seq)
            self._now_holds(fresh.graphs, fresh.graph_bytes)
        except Exception as e:  # noqa: BLE001 - no graphs is a slower path, not a wrong one
            log.warning("decode_graphs_dropped", error=repr(e))

    def choose(self, batch: Sequence[SeqInput], kv_pool: torch.Tensor, layers_landing: bool = False) -> DecodePath:
        page = kv_pool.shape[3]
        return decode_path(
            on_cuda=self.runner.device.type == "cuda", sizes=self.sizes,
            new_tokens=[len(s.token_ids) for s in batch],
            table_widths=[-(-(s.start_pos + len(s.token_ids)) // page) for s in batch],
            max_blocks=self.max_blocks,
            pool_current=self.graphs is not None and self.graphs.pool.data_ptr() == kv_pool.data_ptr(),
            batch_invariant=self.runner.batch_invariant, layers_landing=layers_landing)

    def forward(self, batch: Sequence[SeqInput], kv_pool: torch.Tensor, layer_ready: Sequence | None = None
                ) -> tuple[torch.Tensor, DecodePath]:
        """Logits [B, vocab] float32 of the step, and the path that made them. A graph's logits are
        a view into its output buffer: consumed (sampled) before the next step. ``layer_ready``:
        per layer, the wait for pages a restore is still landing (the eager forward waits in turn)."""
        path = self.choose(batch, kv_pool, layers_landing=layer_ready is not None)
        if path.path == "graph":
            page = kv_pool.shape[3]
            n = len(batch)
            widths = [-(-(s.start_pos + 1) // page) for s in batch]
            tables = np.zeros((n, max(widths)), dtype=np.int32)
            for i, (s, w) in enumerate(zip(batch, widths)):
                tables[i, :w] = s.block_table[:w]
            logits = self.graphs.step(np.fromiter((s.token_ids[0] for s in batch), np.int64, n),
                                      np.fromiter((s.start_pos for s in batch), np.int64, n), tables, kv_pool)
        else:
            logits = self.runner.forward(batch, kv_pool, layer_ready)
        self.num_steps[path.path] += 1
        self.last = path
        return logits, path


__all__ = ["DecodePath", "StepGraphs", "decode_path", "graph_sizes_for", "graph_table_width", "GRAPH_BATCH_SIZES",
           "GRAPH_MAX_TOKENS"]
