"""The Llama-family forward over a paged KV pool, for a mixed batch of prefills and decodes.

A mixture-of-experts model (OLMoE, ``config.is_moe``) runs the same forward with two local
changes: Q and K are RMS-normalised over their full width before RoPE, and each layer's MLP is
``kernels.moe.fused_moe`` (the Triton grouped GEMMs on CUDA, the torch reference on CPU).

    runner = ModelRunner(config, weights, device="cuda", dtype=torch.bfloat16)
    pool = runner.allocate_kv_pool(num_blocks=4096, page_tokens=16)
    logits = runner.forward([SeqInput(prompt_ids, 0, slots_a),        # a prefill
                             SeqInput([last_id], 517, slots_b)], pool)  # a decode, same step
    # logits [2, vocab] float32: the last new token of each sequence

The runner owns no blocks: the caller (the scheduler) passes each sequence's block table of pool
slots; the runner writes the new tokens' K/V into those pages and reads the context from them.
All new tokens of the step go through every matmul together (one [T, hidden] activation); only
attention is per-kind: the Triton decode kernel (torch reference on CPU) for one-token
sequences; for longer ones on the GPU, the Triton extend kernel (pages read in place, keys split
over programs) up to EXTEND_MAX_TOKENS new tokens and SDPA over the gathered pages beyond; SDPA
on CPU (the extend kernel's reference has the same semantics).

Tensor parallelism (``tp=``, see ``tp.py`` and docs/groups.md): the runner holds its rank's heads,
KV heads and MLP columns, all-reduces after the attention output and MLP down projections, and
gathers the vocabulary-split logits; ``self.config`` is then the rank's shape.

NOTE (determinism): the output is a function of (weights, new tokens, pool bytes) only: a prefix
restored from a copy and one computed in place give the same logits. With
``batch_invariant=True`` it also stops depending on the batch around a sequence (fixed-shape
tiled matmuls, fixed-chunk attention), so prefill(A+B) == prefill(A); prefill(B) bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from residency.dataplane.model.attention import paged_attention_invariant, paged_prefill_attention, tiled_linear
from residency.dataplane.model.config import ModelConfig, rope_inv_freq, rope_tables
from residency.dataplane.model.errors import BatchError
from residency.dataplane.model.tp import GroupOps, TensorParallel, TensorParallelRefused, is_sharded, refuse_tp, \
    shard_config, shard_weights
from residency.dataplane.model.weights import Weights
from residency.kernels.attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    rope_and_cache,
    rope_and_cache_ref,
)
from residency.kernels.moe import fused_moe, fused_moe_ref
from residency.kernels.prefill_attention import paged_extend_attention


# A span of at most this many new tokens (a new turn over a cached or restored history) goes
# through the Triton extend kernel, which reads the pages in place and splits the keys over
# programs; longer prefills through SDPA, whose query tiles then fill the GPU by themselves
# (the extend kernel re-reads K/V once per 64 query rows). bench/serve_model.py measures both.
EXTEND_MAX_TOKENS = 512


class LayerReady(Protocol):
    def wait(self) -> object:
        """Return once (CPU) or make the current stream wait until (CUDA) layer l's pages are in place."""


@dataclass
class SeqInput:
    """One sequence's share of a step: ``token_ids`` are new (not yet in the pool) and sit at
    positions ``start_pos``…; ``block_table`` covers positions [0, context_len)."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    context_len: int | None = None      # start_pos + len(token_ids); checked when given


@dataclass
class StepPlan:
    """Device tensors of one step (built by ``ModelRunner.prepare``)."""

    tokens: torch.Tensor                 # [T] int64
    positions: torch.Tensor              # [T] int32
    slots: torch.Tensor                  # [T] int32: pool slot receiving each new token's K/V
    offsets: torch.Tensor                # [T] int32: token index inside that page
    last_rows: torch.Tensor | None       # [B] rows whose logits are returned; None = every row
    all_decode: bool                     # every sequence has one new token: q rows == sequences
    dec_rows: torch.Tensor | None = None         # rows of one-token sequences (mixed steps)
    dec_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32
    dec_context_lens: torch.Tensor | None = None  # [Bd] int32
    # (row0, row1, block_table, start_pos, context_len) of sequences taking the prefill path
    spans: list[tuple[int, int, torch.Tensor, int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: ModelConfig, weights: Weights, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_invariant: bool = False,
                 max_positions: int | None = None, tp: TensorParallel | None = None):
        # With ``tp``, ``config`` is the whole model's and ``weights`` the whole model's or already
        # this rank's share; ``self.config`` is then the share's shape (its heads, KV heads and MLP
        # width: what this rank computes and what its KV pool holds), ``self.model_config`` the whole.
        self.model_config = config
        self.tp = tp
        if tp is not None and tp.size > 1:
            refused = refuse_tp(config, tp.size)
            if refused is not None:
                raise TensorParallelRefused(refused)
            if not is_sharded(weights, config, tp.size):
                weights = shard_weights(weights, config, tp)
            config = shard_config(config, tp.size)
        self.group = GroupOps(tp, config.vocab_size)
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:   # "cuda" and "cuda:0" must compare equal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.w = weights.to(self.device, dtype)
        self.max_positions = int(max_positions or config.max_position)
        cos, sin = rope_tables(rope_inv_freq(config, self.w.rope_freq_factors), self.max_positions)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)
        self._gpu = self.device.type == "cuda"
        # a MoE model whose experts live in host memory and visit device slots (dataplane/model/
        # experts.py): its layers carry no expert stacks and this computes their MLP
        self.experts = None
        if self._gpu:       # a long prefill over cached pages uses it; imported at load, not mid-request
            from torch.nn.attention.bias import causal_lower_right  # noqa: F401, PLC0415

    # ------------------------------------------------------------ pool
    def kv_pool_shape(self, num_blocks: int, page_tokens: int) -> tuple[int, ...]:
        c = self.config
        return (num_blocks, c.num_layers, 2, page_tokens, c.num_kv_heads, c.head_dim)

    def allocate_kv_pool(self, num_blocks: int, page_tokens: int) -> torch.Tensor:
        return torch.empty(self.kv_pool_shape(num_blocks, page_tokens), dtype=self.dtype, device=self.device)

    def check_pool(self, kv_pool: torch.Tensor) -> None:
        want = self.kv_pool_shape(kv_pool.shape[0], kv_pool.shape[3]) if kv_pool.dim() == 6 else None
        if want is None or tuple(kv_pool.shape) != want:
            raise BatchError(f"kv_pool shape {tuple(kv_pool.shape)} does not fit {self.config.name}: "
                             f"want [num_blocks, {self.config.num_layers}, 2, page_tokens, "
                             f"{self.config.num_kv_heads}, {self.config.head_dim}]")
        if kv_pool.dtype != self.dtype or kv_pool.device != self.device:
            raise BatchError(f"kv_pool is {kv_pool.dtype} on {kv_pool.device}; runner is {self.dtype} on {self.device}")
        if not kv_pool.is_contiguous():
            raise BatchError("kv_pool must be contiguous (block-first, one tensor)")

    # ------------------------------------------------------------ step
    def forward(self, batch: Sequence[SeqInput], kv_pool: torch.Tensor,
                layer_ready: Sequence[LayerReady] | None = None) -> torch.Tensor:
        """Write the new tokens' K/V into the pool; return last-token logits [B, vocab] float32.

        ``layer_ready[l].wait()`` is called before layer l touches the pool: a restore that lands
        layer by layer (a ``torch.cuda.Event`` per layer recorded on the copy stream, or a
        ``threading.Event`` on a CPU worker) then overlaps with the layers before it.
        """
        self.check_pool(kv_pool)
        if layer_ready is not None and len(layer_ready) != self.config.num_layers:
            raise BatchError(f"layer_ready has {len(layer_ready)} entries for {self.config.num_layers} layers")
        return self.run(self.prepare(batch, kv_pool), kv_pool, layer_ready)

    def prepare(self, batch: Sequence[SeqInput], kv_pool: torch.Tensor) -> StepPlan:
        """Validate a batch on the host and build its device tensors (one copy per field)."""
        if not batch:
            raise BatchError("empty batch")
        num_blocks, page = kv_pool.shape[0], kv_pool.shape[3]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        last_rows: list[int] = []
        written: set[tuple[int, int]] = set()
        kinds = []
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            ctx = s.start_pos + n
            if n < 1 or s.start_pos < 0:
                raise BatchError(f"sequence {i}: {n} new tokens at start_pos {s.start_pos}")
            if s.context_len is not None and s.context_len != ctx:
                raise BatchError(f"sequence {i}: context_len {s.context_len} != start_pos {s.start_pos} + {n} new tokens")
            if ctx > self.max_positions:
                raise BatchError(f"sequence {i}: context {ctx} exceeds max_positions {self.max_positions}")
            nb = -(-ctx // page)
            bt = list(s.block_table)
            if len(bt) < nb:
                raise BatchError(f"sequence {i}: block table has {len(bt)} slots, context {ctx} needs {nb}")
            if any(not 0 <= b < num_blocks for b in bt[:nb]):
                raise BatchError(f"sequence {i}: block table slot out of range [0, {num_blocks}): {bt[:nb]}")
            for p in range(s.start_pos, ctx):
                target = (bt[p // page], p % page)
                if target in written:
                    raise BatchError(f"sequence {i}: position {p} writes slot {target[0]} offset {target[1]}, "
                                     "which another token of this step also writes")
                written.add(target)
                slots.append(target[0])
                offsets.append(target[1])
            row0 = len(tokens)
            tokens.extend(int(t) for t in s.token_ids)
            positions.extend(range(s.start_pos, ctx))
            last_rows.append(len(tokens) - 1)
            kinds.append((row0, len(tokens), bt[:nb], s.start_pos, ctx))
        dev = self.device

        def ints(xs: list[int], dtype=torch.int32) -> torch.Tensor:
            return torch.tensor(xs, dtype=dtype, device=dev)

        all_decode = all(r1 - r0 == 1 for r0, r1, *_ in kinds)
        plan = StepPlan(
            tokens=ints(tokens, torch.int64), positions=ints(positions), slots=ints(slots),
            offsets=ints(offsets), last_rows=None if all_decode else ints(last_rows, torch.int64),
            all_decode=all_decode and not self.batch_invariant,
        )
        decodes = [k for k in kinds if k[1] - k[0] == 1]
        if self.batch_invariant:
            plan.spans = [(r0, r1, ints(bt, torch.int64), st, ctx) for r0, r1, bt, st, ctx in kinds]
            return plan
        if decodes:
            width = max(len(k[2]) for k in decodes)
            plan.dec_block_tables = ints([k[2] + [0] * (width - len(k[2])) for k in decodes])
            plan.dec_context_lens = ints([k[4] for k in decodes])
            if not all_decode:
                plan.dec_rows = ints([k[0] for k in decodes], torch.int64)
        plan.spans = [(r0, r1, ints(bt, torch.int64), st, ctx) for r0, r1, bt, st, ctx in kinds if r1 - r0 > 1]
        return plan

    def run(self, plan: StepPlan, kv_pool: torch.Tensor, layer_ready: Sequence[LayerReady] | None = None
            ) -> torch.Tensor:
        """The forward over a prepared plan (also what a CUDA graph captures)."""
        w = self.w
        x = self.group.embed(plan.tokens, w.embed)
        for layer, lw in enumerate(w.layers):
            if layer_ready is not None:
                # NOTE: wait before the K/V write, not just before attention: the first new token
                # may share a page with the end of the restored history, and a whole-page copy
                # landing after our write would erase it.
                layer_ready[layer].wait()
            h = self._norm(x, lw.attn_norm)
            qkv = self._linear(h, lw.wqkv, lw.bqkv)
            if lw.q_norm is not None:
                qkv = self._qk_norm(qkv, lw)
            q = self._rope_and_cache(qkv, plan, kv_pool, layer)
            x = x + self.group.reduce(self._linear(self._attend(q, kv_pool, layer, plan), lw.wo))
            h = self._norm(x, lw.mlp_norm)
            x = x + self.group.reduce(self._mlp(h, lw, layer))
        if plan.last_rows is not None:
            x = x.index_select(0, plan.last_rows)
        return self.group.logits(self._linear(self._norm(x, w.final_norm), w.lm_head)).float()

    # ------------------------------------------------------------ pieces
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._gpu:
            # One fused kernel (float32 inside) instead of seven; it scales before the cast back,
            # transformers after: at most one bf16 ulp apart.
            return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_eps)
        # transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return weight * xf.to(x.dtype)

    def _qk_norm(self, qkv: torch.Tensor, lw) -> torch.Tensor:
        """OLMoE: RMSNorm over all of Q and all of K (not per head), then the optional clamp."""
        c = self.config
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        qkv = torch.cat([self._norm(q, lw.q_norm), self._norm(k, lw.k_norm), v], dim=-1)
        if c.clip_qkv is not None:
            qkv = qkv.clamp_(-c.clip_qkv, c.clip_qkv)
        return qkv

    def _mlp(self, h: torch.Tensor, lw, layer: int) -> torch.Tensor:
        if lw.router is None:
            gate, up = self._linear(h, lw.w_gate_up).chunk(2, dim=-1)
            return self._linear(F.silu(gate) * up, lw.w_down)
        if lw.w_experts_gate_up is None:           # offloaded: the same math over device slots
            if self.experts is None:
                raise BatchError(f"layer {layer} has no expert weights and no expert offload is attached")
            if self.batch_invariant:
                return self.experts.mlp(h, layer, lw.router, linear=tiled_linear, fused=False)
            return self.experts.mlp(h, layer, lw.router)
        c = self.config
        if self.batch_invariant:      # the reference's per-expert matmuls in fixed tiles
            return fused_moe_ref(h, lw.router, lw.w_experts_gate_up, lw.w_experts_down, c.num_experts_per_tok,
                                 c.norm_topk_prob, linear=tiled_linear)
        return fused_moe(h, lw.router, lw.w_experts_gate_up, lw.w_experts_down, c.num_experts_per_tok,
                         c.norm_topk_prob)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant:
            return tiled_linear(x, w, b)
        return F.linear(x, w, b)

    def _rope_and_cache(self, qkv: torch.Tensor, plan: StepPlan, kv_pool: torch.Tensor, layer: int) -> torch.Tensor:
        fn = rope_and_cache if self._gpu else rope_and_cache_ref
        return fn(qkv, self.cos, self.sin, plan.positions, plan.slots, plan.offsets, kv_pool, layer,
                  self.config.num_heads)

    def _attend(self, q: torch.Tensor, kv_pool: torch.Tensor, layer: int, plan: StepPlan) -> torch.Tensor:
        T = q.shape[0]
        decode = paged_decode_attention if self._gpu else paged_decode_attention_ref
        if plan.all_decode:
            return decode(q, kv_pool, layer, plan.dec_block_tables, plan.dec_context_lens,
                          self.sm_scale).view(T, -1)
        out = torch.empty_like(q)
        if plan.dec_block_tables is not None:
            qd = q.index_select(0, plan.dec_rows)
            out.index_copy_(0, plan.dec_rows, decode(qd, kv_pool, layer, plan.dec_block_tables,
                                                     plan.dec_context_lens, self.sm_scale))
        for r0, r1, bt, start, ctx in plan.spans:
            if self.batch_invariant:
                out[r0:r1] = paged_attention_invariant(q[r0:r1], kv_pool, layer, bt, start, ctx, self.sm_scale)
            elif self._gpu and r1 - r0 <= EXTEND_MAX_TOKENS:
                paged_extend_attention(q[r0:r1], kv_pool, layer, bt, start, self.sm_scale, out=out[r0:r1])
            else:
                out[r0:r1] = paged_prefill_attention(q[r0:r1], kv_pool, layer, bt, start, ctx, self.sm_scale)
        return out.view(T, -1)
