"""Experts as units of residency: an MoE model whose experts live in pinned host memory and visit
a budget of device slots as the routing asks for them.

    model, offload = prepare_offload(load_model(path, device="cpu"), parse_expert_budget("25%"), "cuda")
    offload.pin(mover.pinned)        # every expert into pinned host buffers, on the worker's PinnedBudget
    model.runner.forward(...)        # each MoE layer: offload.mlp(h, layer, router)
    offload.drain(worker, step)      # -> [ExpertsMoved] for the ledger, once per step

One MoE layer of a step (``mlp``):

    route (router, softmax, top-k)  ->  hit experts (one host sync: which ones, how often)
    wait for this layer's prefetch  ->  issue the next layer's prefetch on a side stream (hot experts
                                        by measured frequency), overlapping this layer's compute; the
                                        last layer prefetches layer 0 for the next step
    for each pass of at most S hit experts (ascending ids):
        fetch the missing ones host -> device slots, evicting the coldest resident (expert_policy)
        the fused kernel over the slot stacks, expert ids remapped to slots (``fused_moe_rows``)
    sum each token's top-k rows

On a CPU the same code runs in order (copies are synchronous, the prefetch lands before the
layer that reads it) and the expert math is the reference loop, over the slots.

Greedy output equals the all-resident model's bit for bit: routing is computed the same way from
the same activations, each (token, choice) row's arithmetic does not depend on which slot or pass
holds its expert, and the reference path keeps the ascending order in which it adds experts
(``plan_passes``). Residency is a placement decision, never a numerics decision.

Every copy and eviction is recorded (kind, layer, expert, bytes, measured ns) and leaves the worker
as one ``ExpertsMoved`` event per step that moved anything.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from residency.dataplane.model.config import ModelConfig
from residency.dataplane.model.errors import ModelError
from residency.dataplane.model.expert_policy import (
    ExpertBudget, RoutingFrequency, choose_prefetch, choose_victims, plan_passes, slots_for_budget,
)
from residency.dataplane.model.loader import LoadedModel
from residency.dataplane.model.runner import ModelRunner
from residency.dataplane.model.weights import Weights
from residency.dataplane.pools.budget import PinnedBudget, page_round
from residency.events.catalog import ExpertMove, ExpertsMoved
from residency.kernels._common import use_triton
from residency.kernels.moe import accumulate_experts_ref, fused_moe_rows, route

PINNED_OWNER = "experts"
Stacks = list[tuple[torch.Tensor, torch.Tensor]]       # per layer: gate_up [E, 2I, H], down [E, H, I]


def split_experts(weights: Weights) -> tuple[Weights, Stacks]:
    """The weights without their expert stacks (what goes to the device whole), and the stacks."""
    stacks = [(lw.w_experts_gate_up, lw.w_experts_down) for lw in weights.layers]
    if any(gu is None for gu, _ in stacks):
        raise ModelError("experts can be offloaded only from a MoE model whose every layer has expert stacks")
    layers = [dataclasses.replace(lw, w_experts_gate_up=None, w_experts_down=None) for lw in weights.layers]
    return dataclasses.replace(weights, layers=layers), stacks


class ExpertOffload:
    def __init__(self, config: ModelConfig, stacks: Stacks, num_slots: int, device: torch.device | str,
                 dtype: torch.dtype):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.L, self.E, self.S = config.num_layers, config.num_experts, int(num_slots)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.expert_bytes = config.expert_bytes(dtype)
        # wherever they are (the host when serving; the bench's are on the device): ``pin`` copies them
        self._stacks: Stacks | None = [(gu.to(dtype=dtype), dn.to(dtype=dtype)) for gu, dn in stacks]
        h, i = config.hidden, config.intermediate
        self.slots_gu = [torch.empty(self.S, 2 * i, h, dtype=dtype, device=self.device) for _ in range(self.L)]
        self.slots_dn = [torch.empty(self.S, h, i, dtype=dtype, device=self.device) for _ in range(self.L)]
        self.slot_expert = [[-1] * self.S for _ in range(self.L)]        # slot -> expert (-1: empty)
        self.expert_slot: list[dict[int, int]] = [{} for _ in range(self.L)]
        self.freq = RoutingFrequency(self.L, self.E)
        self.prefetch_cap = self.top_k      # per layer and step: at most one token's worth of experts
        self.host_gu: list[torch.Tensor] = []
        self.host_dn: list[torch.Tensor] = []
        self._buffers = []
        self.gpu = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.gpu else None
        self._prefetched: list[torch.cuda.Event | None] = [None] * self.L
        # the device thread appends, the device thread (after a step) or the I/O thread (at Hello) drains
        self._lock = threading.Lock()
        self._moves: list[list] = []                 # [kind, layer, expert, bytes, ns | None]
        self._timed: list[tuple[list, object, object]] = []   # (move, start event, end event) on CUDA
        self._served = [0, 0]                        # bytes (on the device already, fetched on demand) since drain
        self.totals = {"served_device_bytes": 0, "served_fetched_bytes": 0, "fetch": 0, "prefetch": 0, "evict": 0,
                       "fetched_bytes": 0}

    # ------------------------------------------------------------ sizes
    @property
    def host_bytes_needed(self) -> int:
        """Pinned bytes ``pin`` registers: two page-rounded buffers a layer."""
        h, i = self.config.hidden, self.config.intermediate
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.L * (page_round(self.E * 2 * i * h * elem) + page_round(self.E * h * i * elem))

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the slots (allocated once, whatever they hold)."""
        return self.L * self.S * self.expert_bytes

    @property
    def device_bytes(self) -> int:
        """Expert bytes in device slots now."""
        return sum(len(m) for m in self.expert_slot) * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return self.L * self.E * self.expert_bytes

    # ------------------------------------------------------------ host copies
    def pin(self, pinned: PinnedBudget) -> None:
        """Copy every expert into pinned buffers registered with ``pinned`` (owner "experts"; a
        refusal raises PinnedBudgetExceeded and nothing stays registered), then fill each layer's
        slots with its first S experts (nothing is measured yet to prefer others)."""
        if self._stacks is None:
            raise ModelError("experts are already pinned")
        try:
            for gu, dn in self._stacks:
                for t, dst in ((gu, self.host_gu), (dn, self.host_dn)):
                    buf = pinned.alloc(PINNED_OWNER, tuple(t.shape), t.dtype)
                    self._buffers.append(buf)
                    buf.tensor.copy_(t)
                    dst.append(buf.tensor)
        except BaseException:
            self.close()
            raise
        self._stacks = None
        for layer in range(self.L):
            for e in range(self.S):
                self._fetch(layer, e, e, "fetch", None)

    def close(self) -> None:
        """Give the pinned buffers back (the slots go with the object)."""
        for b in self._buffers:
            b.close()
        self._buffers, self.host_gu, self.host_dn = [], [], []

    # ------------------------------------------------------------ the layer
    def mlp(self, h: torch.Tensor, layer: int, router: torch.Tensor,
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear, fused: bool | None = None
            ) -> torch.Tensor:
        """The MoE MLP of ``h`` [T, H] at ``layer`` over its device slots (see the module docstring).
        ``fused``: the Triton kernel (default where it runs), else the reference loop with ``linear``."""
        if not self.host_gu:
            raise ModelError("expert offload: pin() the experts before the first forward")
        T, H = h.shape
        if T == 0:
            return h.new_empty(0, H)
        fused = use_triton(h.device) if fused is None else fused
        weights, experts = route(h, router, self.top_k, self.renormalize, linear)
        counts = torch.bincount(experts.reshape(-1), minlength=self.E).tolist()     # the one host sync
        hit = [e for e, c in enumerate(counts) if c]
        self.freq.observe(layer, counts)
        if self._prefetched[layer] is not None:          # its copies before any fetch or read of this layer
            torch.cuda.current_stream(self.device).wait_event(self._prefetched[layer])
            self._prefetched[layer] = None
        resident = self.expert_slot[layer]
        on_device = sum(1 for e in hit if e in resident) * self.expert_bytes
        with self._lock:
            self._served[0] += on_device
            self._served[1] += len(hit) * self.expert_bytes - on_device
        # the next layer's likely experts ride beside this layer's compute on the GPU; after the last
        # layer that is layer 0 of the next step (its copies overlap the head, the sampling and the
        # next step's embedding, and the side stream starts after everything enqueued so far)
        self._prefetch((layer + 1) % self.L)
        passes = plan_passes(hit, self.S)
        rows = torch.empty(T * self.top_k, H, dtype=h.dtype, device=h.device) if fused else None
        out = None if fused else torch.zeros_like(h)
        for chunk in passes:
            self._make_resident(layer, chunk)
            slot_of = self.expert_slot[layer]
            if fused:
                lut = [self.S] * self.E
                for e in chunk:
                    lut[e] = slot_of[e]
                slots = torch.tensor(lut, dtype=torch.int64, device=h.device)[experts]
                fused_moe_rows(h, weights, slots, self.slots_gu[layer], self.slots_dn[layer], rows,
                               skip_id=self.S if len(passes) > 1 else None)
            else:
                accumulate_experts_ref(h, weights, experts, self.slots_gu[layer], self.slots_dn[layer], out, chunk,
                                       slot_of.__getitem__, linear)
        return rows.view(T, self.top_k, H).sum(dim=1) if fused else out

    def _make_resident(self, layer: int, chunk: list[int]) -> None:
        """Fetch the experts of ``chunk`` not in a slot, into free slots or those of the coldest
        residents outside ``chunk``."""
        resident = self.expert_slot[layer]
        missing = [e for e in chunk if e not in resident]
        if not missing:
            return
        free = [s for s, e in enumerate(self.slot_expert[layer]) if e < 0]
        victims = choose_victims(resident, set(chunk), self.freq.of(layer), len(missing) - len(free))
        free += [self._evict(layer, v) for v in victims]
        for e, s in zip(missing, free):
            self._fetch(layer, e, s, "fetch", None)

    def _prefetch(self, layer: int) -> None:
        resident = self.expert_slot[layer]
        free = sum(1 for e in self.slot_expert[layer] if e < 0)
        picks = choose_prefetch(resident, free, self.freq.of(layer), self.prefetch_cap)
        if not picks:
            return
        if self.gpu:
            # NOTE: the side stream must not overwrite a slot a kernel already enqueued still reads
            # (this layer at the previous step): it starts after everything enqueued so far.
            self.side.wait_stream(torch.cuda.current_stream(self.device))
        for e, victim in picks:
            s = self._evict(layer, victim) if victim is not None else self.slot_expert[layer].index(-1)
            self._fetch(layer, e, s, "prefetch", self.side)
        if self.gpu:
            done = torch.cuda.Event()
            done.record(self.side)
            self._prefetched[layer] = done

    # ------------------------------------------------------------ moves
    def _evict(self, layer: int, expert: int) -> int:
        s = self.expert_slot[layer].pop(expert)
        self.slot_expert[layer][s] = -1
        self._record(["evict", layer, expert, self.expert_bytes, 0])
        return s

    def _fetch(self, layer: int, expert: int, slot: int, kind: str, stream) -> None:
        """Copy ``expert``'s host matrices into ``slot`` (on ``stream``, or the current one)."""
        src_gu, src_dn = self.host_gu[layer][expert], self.host_dn[layer][expert]
        dst_gu, dst_dn = self.slots_gu[layer][slot], self.slots_dn[layer][slot]
        move = [kind, layer, expert, self.expert_bytes, None]
        if self.gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                start.record()
                dst_gu.copy_(src_gu, non_blocking=True)
                dst_dn.copy_(src_dn, non_blocking=True)
                end.record()
            self._record(move, (start, end))
        else:
            t0 = time.perf_counter_ns()
            dst_gu.copy_(src_gu)
            dst_dn.copy_(src_dn)
            move[4] = time.perf_counter_ns() - t0
            self._record(move)
        self.slot_expert[layer][slot] = expert
        self.expert_slot[layer][expert] = slot

    def _record(self, move: list, events: tuple | None = None) -> None:
        with self._lock:
            self._moves.append(move)
            if events is not None:
                self._timed.append((move, *events))
            self.totals[move[0]] += 1
            if move[0] != "evict":
                self.totals["fetched_bytes"] += move[3]

    def drain(self, worker: int, step: int) -> list[ExpertsMoved]:
        """The moves since the last drain as one ``ExpertsMoved`` (none if nothing moved). The
        served bytes count since the previous event, so steps that moved nothing still count."""
        with self._lock:
            moves, timed, self._moves, self._timed = self._moves, self._timed, [], []
            if not moves:
                return []
            served, self._served = self._served, [0, 0]
            self.totals["served_device_bytes"] += served[0]
            self.totals["served_fetched_bytes"] += served[1]
        for move, start, end in timed:
            end.synchronize()
            move[4] = int(start.elapsed_time(end) * 1e6)
        out = [ExpertMove(kind=k, layer=layer, expert=e, bytes=b, ns=ns) for k, layer, e, b, ns in moves]
        return [ExpertsMoved(worker=worker, step=step, moves=out,
                             fetched_bytes=sum(m.bytes for m in out if m.kind != "evict"),
                             device_bytes=self.device_bytes, host_bytes=self.host_bytes,
                             served_device_bytes=served[0], served_fetched_bytes=served[1],
                             num_layers=self.L, num_experts=self.E)]

    def served_totals(self) -> tuple[int, int]:
        """(bytes on the device already, bytes fetched on demand) over the whole run, drained or not."""
        with self._lock:
            return (self.totals["served_device_bytes"] + self._served[0],
                    self.totals["served_fetched_bytes"] + self._served[1])

    def check_integrity(self) -> None:
        for layer in range(self.L):
            fwd = {e: s for s, e in enumerate(self.slot_expert[layer]) if e >= 0}
            if fwd != self.expert_slot[layer]:
                raise ModelError(f"layer {layer}: slot table {self.slot_expert[layer]} disagrees with "
                                 f"expert map {self.expert_slot[layer]}")


def prepare_offload(model: LoadedModel, budget: ExpertBudget, device: torch.device | str | None = None
                    ) -> tuple[LoadedModel, ExpertOffload]:
    """``model`` (its weights anywhere, typically loaded on the CPU) as a runner on ``device``
    whose experts are offloaded: everything else on the device, S slots a layer allocated there.
    Call ``offload.pin(budget)`` before the first forward."""
    c = model.config
    if not c.is_moe:
        raise ModelError(f"{c.name} is not a mixture-of-experts model: it has no experts to offload")
    r = model.runner
    device = torch.device(device) if device is not None else r.device
    slots = slots_for_budget(budget, num_layers=c.num_layers, num_experts=c.num_experts,
                             expert_bytes=c.expert_bytes(r.dtype))
    stripped, stacks = split_experts(model.weights)
    offload = ExpertOffload(c, stacks, slots, device, r.dtype)
    runner = ModelRunner(c, stripped, device=device, dtype=r.dtype, batch_invariant=r.batch_invariant,
                         max_positions=r.max_positions)
    runner.experts = offload
    return dataclasses.replace(model, runner=runner, weights=runner.w), offload


def offload_model(model: LoadedModel, budget: ExpertBudget, device: torch.device | str | None = None,
                  pinned: PinnedBudget | None = None) -> tuple[LoadedModel, ExpertOffload]:
    """``prepare_offload`` and ``pin`` in one (tests, benches): a pinned budget of exactly the
    experts' bytes unless one is given."""
    model, offload = prepare_offload(model, budget, device)
    offload.pin(pinned or PinnedBudget(offload.host_bytes_needed, pin=offload.gpu))
    return model, offload


__all__ = ["ExpertOffload", "PINNED_OWNER", "offload_model", "prepare_offload", "split_experts"]
