"""Tensor parallelism for the Llama-family runner: which rows and columns a rank keeps, the
refusal of shapes that do not split, and the three collectives of a step.

Megatron's split of a decoder layer over ``size`` ranks (rank r keeps the r-th equal part):

    wqkv      [Q heads | K heads | V heads] rows     -> each of the three parts split by heads
    wo        [hidden, Q heads·head_dim]             -> columns of rank r's Q heads; ALL-REDUCE after
    w_gate_up [gate | up] rows                       -> gate and up each split by rows
    w_down    [hidden, intermediate]                 -> columns of rank r's intermediate; ALL-REDUCE after
    norms, RoPE tables                               -> replicated (a few KB; every rank needs all of them)
    embed, lm_head [vocab, hidden]                   -> vocabulary rows: rank r keeps ceil(V/size) of them
                                                        (the last rank zero-padded); a lookup is masked to
                                                        the rank's rows and ALL-REDUCED, the LM head's
                                                        logits ALL-GATHERED

Attention needs no collective: a query head reads only its own KV head, and rank r holds
both (GQA groups never straddle ranks because num_heads and num_kv_heads both divide by size).
So a rank's KV pool holds only its KV heads: a block's bytes per rank are the full block's / size.

The vocabulary is split too (not replicated) because for Llama-3-8B the embedding and the LM head
are 1 GiB each in bf16: replicated, the LM head alone would be read whole by every rank every
decode step (a quarter of a TP=2 rank's weight reads). A vocab lookup's all-reduce sums one row
with zeros, and the all-gather concatenates: both are exact, so the split changes no bits of them.

After each all-reduce every rank holds the same bits (ring reductions reduce each chunk once and
broadcast it), so every rank computes the same logits and, greedy or seeded alike, the same token.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from residency.dataplane.model.config import ModelConfig
from residency.dataplane.model.errors import UnsupportedModel


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank ``rank`` of ``size``. ``group`` is a
    ``torch.distributed`` process group; None means the default (world) group."""

    rank: int
    size: int
    group: object | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size}: want size >= 1 and 0 <= rank < size")


@dataclass(frozen=True)
class Refused:
    """A tensor-parallel size the model cannot be split into, with the arithmetic: each entry of
    ``remainders`` is (what, count, size, count % size) for a count that must divide by size;
    ``reason`` says it in words (also for refusals without arithmetic, such as MoE)."""

    model: str
    size: int
    reason: str
    remainders: tuple[tuple[str, int, int, int], ...] = ()


class TensorParallelRefused(UnsupportedModel):
    """A runner or loader asked for a split that ``refuse_tp`` refuses; ``.refused`` holds it."""

    def __init__(self, refused: Refused):
        super().__init__(refused.reason)
        self.refused = refused


def refuse_tp(config: ModelConfig, size: int) -> Refused | None:
    """None if ``config`` splits over ``size`` ranks; else the refusal with its arithmetic.

    Query heads, KV heads and the MLP width must each divide by size (KV heads are not
    replicated across ranks: a model with fewer KV heads than ranks is refused, not copied).
    """
    if size < 1:
        return Refused(config.name, size, f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return None
    if config.is_moe or config.qk_norm:
        # NOTE: OLMoE's q/k norms are RMSNorms over the WHOLE Q and K width (a sum of squares over
        # every head: one more all-reduce per layer), and its experts would split best across
        # ranks (expert parallelism), not by columns. Neither is built.
        return Refused(config.name, size, f"{config.name}: a mixture-of-experts model ({config.model_type}) is not "
                       f"split over ranks (tensor parallelism covers dense Llama-family models); use --tp 1")
    rem = tuple((what, n, size, n % size) for what, n in (
        ("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads), ("intermediate", config.intermediate))
        if n % size)
    if not rem:
        return None
    words = "; ".join(f"{what} {n} % {s} = {r}" for what, n, s, r in rem)
    return Refused(config.name, size, f"{config.name} does not split over {size} ranks: {words} "
                   f"(each must divide by the tensor-parallel size)", rem)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank computes and stores: its heads, KV heads and MLP width (vocab_size stays
    the whole model's: the logits a step returns are whole)."""
    refused = refuse_tp(config, size)
    if refused is not None:
        raise TensorParallelRefused(refused)
    if size == 1:
        return config
    return config.replace(num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                          intermediate=config.intermediate // size)


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head each rank keeps: ceil(V / size) (the last rank pads)."""
    return -(-vocab_size // size)


class Shard:
    """What rank ``rank`` of ``size`` keeps of each matrix, as functions of a checkpoint tensor.

    Each takes anything sliceable the way a tensor is, with ``.shape`` or ``.get_shape()`` (a
    torch tensor, or safetensors' lazy slice, which then reads only the rows kept) and returns a
    tensor that owns its storage (a view would pin the whole checkpoint tensor in memory).
    """

    def __init__(self, config: ModelConfig, rank: int, size: int):
        refused = refuse_tp(config, size)
        if refused is not None:
            raise TensorParallelRefused(refused)
        self.config, self.rank, self.size = config, rank, size

    def _part(self, x, dim: int) -> torch.Tensor:
        n = _shape(x)[dim]
        if n % self.size:
            raise UnsupportedModel(f"{self.config.name}: dim {dim} of {n} does not split over {self.size} ranks")
        per = n // self.size
        idx = (slice(None),) * dim + (slice(self.rank * per, (self.rank + 1) * per),)
        return _owned(x[idx])

    def rows(self, x) -> torch.Tensor:
        """Rows split evenly: q_proj / k_proj / v_proj (heads are runs of head_dim rows), their
        biases, gate_proj, up_proj."""
        return self._part(x, 0)

    def cols(self, x) -> torch.Tensor:
        """Columns split evenly: o_proj (by Q heads), down_proj (by intermediate)."""
        return self._part(x, 1)

    def vocab(self, x) -> torch.Tensor:
        """Rank r's rows of an embedding or LM head, zero-padded to ``vocab_rows``."""
        v = _shape(x)[0]
        per = vocab_rows(v, self.size)
        lo, hi = min(self.rank * per, v), min((self.rank + 1) * per, v)
        kept = _owned(x[lo:hi])
        if hi - lo == per:
            return kept
        pad = kept.new_zeros(per - (hi - lo), *kept.shape[1:])
        return torch.cat([kept, pad])

    def fused(self, x: torch.Tensor, parts: list[int]) -> torch.Tensor:
        """Rows of a matrix fused from several (wqkv = Q|K|V, w_gate_up = gate|up): each part split."""
        return torch.cat([self.rows(p) for p in x.split(parts, dim=0)])


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x.get_shape())


def _owned(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def shard_weights(weights, config: ModelConfig, tp: TensorParallel):
    """Rank ``tp.rank``'s share of whole-model ``weights`` (random weights, or weights loaded
    without a shard). The loader shards while reading instead (``load_model(..., tp=...)``)."""
    from residency.dataplane.model.weights import LayerWeights, Weights  # noqa: PLC0415 - weights imports nothing of tp

    if tp.size == 1:
        return weights
    s = Shard(config, tp.rank, tp.size)
    nq, nkv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate
    layers = []
    for lw in weights.layers:
        layers.append(LayerWeights(
            attn_norm=lw.attn_norm, wqkv=s.fused(lw.wqkv, [nq, nkv, nkv]),
            bqkv=None if lw.bqkv is None else s.fused(lw.bqkv, [nq, nkv, nkv]),
            wo=s.cols(lw.wo), mlp_norm=lw.mlp_norm,
            w_gate_up=s.fused(lw.w_gate_up, [inter, inter]), w_down=s.cols(lw.w_down)))
    embed = s.vocab(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else s.vocab(weights.lm_head)
    return Weights(embed, layers, weights.final_norm, lm_head, weights.rope_freq_factors)


def is_sharded(weights, config: ModelConfig, size: int) -> bool:
    """Whether ``weights`` already hold one rank's share of ``config`` split over ``size``
    (told apart by the fused QKV rows); raises if they fit neither."""
    rows = weights.layers[0].wqkv.shape[0] if weights.layers else None
    # NOTE: hollow weights (no rows: bound later to a flip arena holding the rank's share, which
    # serve reads already cut: dataplane/weights_models.py) are taken as the share
    if size == 1 or rows is None or rows == 0:
        return True
    part = shard_config(config, size)
    if rows == part.qkv_rows:
        return True
    if rows == config.qkv_rows:
        return False
    raise UnsupportedModel(f"{config.name}: weights with {rows} QKV rows are neither the whole model's "
                           f"({config.qkv_rows}) nor one of {size} ranks' ({part.qkv_rows})")


def random_shard_weights(config: ModelConfig, tp: TensorParallel, device="cpu", dtype=torch.float32, seed: int = 0):
    """Random weights of one rank's shape, drawn on ``device`` without ever building the whole
    model (the GPU bench's Llama-3-8B at TP=2: 8 GB per rank, not 16). Not the shard of any
    whole model: for speed only, never for comparing numerics across sizes."""
    from residency.dataplane.model.weights import random_weights  # noqa: PLC0415

    part = shard_config(config, tp.size).replace(vocab_size=vocab_rows(config.vocab_size, tp.size))
    return random_weights(part, device=device, dtype=dtype, seed=seed * 1009 + tp.rank)


class GroupOps:
    """The collectives of one rank's step. With ``tp`` None (or size 1) each is the single-process
    operation itself: the runner calls them unconditionally."""

    def __init__(self, tp: TensorParallel | None, vocab_size: int):
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.vocab_size = vocab_size
        self.per = vocab_rows(vocab_size, tp.size) if self.tp else vocab_size

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of ``tokens`` [T] from the (rank's share of the) embedding: [T, hidden]."""
        if self.tp is None:
            return F.embedding(tokens, table)
        local = tokens - self.tp.rank * self.per
        outside = (local < 0) | (local >= self.per)
        x = F.embedding(local.clamp(0, self.per - 1), table).masked_fill(outside[:, None], 0)
        return self.reduce(x)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial ``x`` (in place): after wo and w_down."""
        if self.tp is not None:
            import torch.distributed as dist  # noqa: PLC0415

            dist.all_reduce(x, group=self.tp.group)
        return x

    def logits(self, local: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits [B, vocab] from each rank's [B, vocab_rows] columns."""
        if self.tp is None:
            return local
        import torch.distributed as dist  # noqa: PLC0415

        B = local.shape[0]
        out = local.new_empty(self.tp.size * B, self.per)
        # all_gather_single is all_gather_into_tensor's newer name (the old one warns from torch 2.13)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local.contiguous(), group=self.tp.group)
        return out.view(self.tp.size, B, self.per).permute(1, 0, 2).reshape(B, -1)[:, :self.vocab_size]


def init_group(rank: int, size: int, init_method: str, backend: str | None = None, *,
               device: torch.device | str | None = None, timeout_s: float = 600.0) -> TensorParallel:
    """Join the default process group as ``rank`` of ``size`` and return its TensorParallel.

    ``init_method``: "tcp://host:port" (rank 0 listens) or "file:///path" (a fresh file).
    ``backend``: "nccl" for CUDA ranks, "gloo" for CPU ranks (chosen from ``device`` when None).
    A CUDA rank is bound to ``device`` first (NCCL needs the current device set). ``timeout_s``
    bounds every collective: a peer that died mid-step fails this rank's step instead of hanging it.
    """
    import torch.distributed as dist  # noqa: PLC0415

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp = TensorParallel(rank, size, None)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return tp


def close_group() -> None:
    """Leave the process group (idempotent)."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        dist.destroy_process_group()
