"""A worker that serves a model: the model decides the KV layout, the tier mover's device pool holds it.

``python -m residency.dataplane.proc ... --model PATH|embedded`` builds its core here instead of from
``--kv-layout``: the layout (layers, kv heads, head dim, dtype) comes from the model, so the pages
the Mover parks and restores are exactly the pages the model writes. The serving loop joins the
worker's device thread:

    commands  Generate, CancelGenerate            ─► ServingLoop.handle
    side      Tokenize (the worker's side threads) ─► ServingLoop.handle, beside the steps
    idle      while a sequence runs               ─► ServingLoop.step (one batched forward)
    guard     ExecuteMove / ReleaseBlocks naming pages a running sequence reads or writes are
              refused (MoveRejected / CommandFailed): a policy must never pull a page from under
              the model
    hello     ServingReady follows every Hello (a restarted control process learns the model again)
"""
from __future__ import annotations

import os
import re

import structlog

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.group import RENDEZVOUS_S, GroupRefused, group_spec
from residency.dataplane.worker import WorkerCore
from residency.events import catalog as ev
from residency.events.commands import (
    CancelGenerate, CommandFailed, ExecuteMove, Generate, ReleaseBlocks, SwapWeights, Tokenize, Tokenized,
    TokensGenerated,
)

log = structlog.get_logger("dataplane.serving")
DTYPES = ("bfloat16", "float16", "float32")
MAX_SEQS = 64          # sequences one step batches (and the largest decode graph captured)


def add_serving_args(p) -> None:
    g = p.add_argument_group("serving (with --model)")
    g.add_argument("--model", default=None, action="append",
                   help="a GGUF file, a Hugging Face directory, or 'embedded' (SmolLM2); NAME=PATH, repeated, "
                        "serves several models from one weights arena (the first is resident at start)")
    g.add_argument("--expert-budget", default=None, metavar="FRACTION|BYTES",
                   help="a MoE model: device bytes for its experts (50%%, 0.25 or 6GiB); the rest stay in pinned "
                        "host memory and are fetched when routed to (docs/moe.md)")
    g.add_argument("--flip-host-copies", default="auto", choices=("auto", "off"),
                   help="two models; auto: keep both images in pinned host memory when the host's measured free "
                        "memory allows, so a flip copies only the incoming one (default; docs/flip.md); off: "
                        "every flip runs the rotation")
    g.add_argument("--served-model-name", default=None, help="the model id clients name (default: from the file)")
    g.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--page-tokens", type=int, default=16)
    g.add_argument("--max-step-tokens", type=int, default=256, help="new tokens per forward step (prefill chunking)")
    g.add_argument("--max-context", type=int, default=None, help="cap the model's context window")


def model_id_for(path: str | None) -> str:
    if not path or path == "embedded":
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(path))
    if name.lower().endswith(".gguf"):
        name = name[:-5]
        name = re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name


def build_serving_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    spec = group_spec(args)
    if getattr(args, "expert_budget", None):
        if spec is not None:
            raise GroupRefused(f"--tp {spec.ranks}: --expert-budget offloads a mixture-of-experts model, which is "
                               "not split over ranks")
        return build_offload_core(args, faults)
    import torch  # noqa: PLC0415 - seconds of import, only for a worker that serves

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.restore_pipeline import KeptRestores  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.pools.budget import page_round  # noqa: PLC0415
    from residency.dataplane.serving import ServingLoop  # noqa: PLC0415
    from residency.dataplane.serving_graphs import StepGraphs  # noqa: PLC0415
    from residency.dataplane.model import block_content_keys  # noqa: PLC0415
    from residency.dataplane.flip.arena import WeightsArena  # noqa: PLC0415
    from residency.dataplane.flip.image import DEFAULT_CHUNK_BYTES  # noqa: PLC0415
    from residency.dataplane.flip.slab import HostSlab  # noqa: PLC0415
    from residency.dataplane.weights_models import load_models, pack_into, parse_model_specs  # noqa: PLC0415
    from residency.dataplane.weights_models import rotation_chunk_bytes, store_in_slab  # noqa: PLC0415
    from residency.dataplane.weights_models import host_available_bytes, host_copy_bytes  # noqa: PLC0415
    from residency.dataplane.weights_swap import GraphsReader, ServingReader, WeightsSwapper  # noqa: PLC0415

    from residency.dataplane import sizing as sz  # noqa: PLC0415
    from residency.dataplane.build import pool_sizing  # noqa: PLC0415
    from residency.dataplane.memory_books import MemoryBooks  # noqa: PLC0415
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415
    from residency.dataplane.model.tp import TensorParallel, TensorParallelRefused, init_group  # noqa: PLC0415

    device = args.device
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    specs = parse_model_specs(args.model, args.served_model_name, model_id_for)
    meter = sz.Meter(device)
    cuda = device.startswith("cuda")
    # every model read once (a group's rank: its share of each); the first one's weights go to the
    # arena, the second one's to the slab; the arena is sized for the largest share
    tp = TensorParallel(spec.rank, spec.ranks) if spec is not None else None
    try:       # a model that does not split is refused before a weight is read or a peer met
        loaded = load_models(specs, device, dtype, args.page_tokens, args.max_context, tp=tp)
    except TensorParallelRefused as e:
        raise GroupRefused(f"--tp {spec.ranks}: {e}") from None
    if spec is not None:     # before the graphs: their capture runs the step's collectives
        init_group(spec.rank, spec.ranks, spec.init, device=device, timeout_s=RENDEZVOUS_S)
    models, first = loaded.models, loaded.models[0]
    c = first.model.config
    kv = KVLayout(c.num_layers, args.page_tokens, c.num_kv_heads, c.head_dim, dtype=dtype)
    min_blocks = sz.min_blocks_for(max(m.model.runner.max_positions for m in models), args.page_tokens)
    reserve = max(sz.activation_reserve(device, args.max_step_tokens, m.model.config.hidden,
                                        m.model.config.intermediate, m.model.config.vocab_size) for m in models)
    if args.device_blocks is None:      # the largest image plus the smallest pool must fit the share
        arena_fits(args, meter, loaded.arena_bytes, max(models, key=lambda m: m.nbytes).name, kv.block_bytes,
                   min_blocks, reserve)
    before = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    arena = WeightsArena(loaded.arena_bytes, device)
    pack_into(arena.buffer, first.manifest, loaded.host.pop(first.name))
    several = len(models) > 1
    # checksummed now when a flip may take it out; a single model's image at its first sleep
    arena.adopt(first.name, first.manifest, [first.reader], chunk_bytes=DEFAULT_CHUNK_BYTES if several else None,
                gen=0)
    first.sums = arena.image.sums
    weights_bytes = arena.capacity_bytes
    allocator_bytes = torch.cuda.memory_allocated(torch.device(device)) - before if cuda else None
    sizing = pool_sizing(args, meter, kv.block_bytes, weights_bytes, min_blocks, reserve)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    chunk, ring = rotation_chunk_bytes(loaded.arena_bytes), 2
    slab_bytes = HostSlab.capacity_for([m.nbytes for m in models], chunk, ring) if several else 0
    # the pinned budget also funds the weights: the slab (several models) and a sleep's host copy
    pinned = (Mover.pinned_bytes_needed(kv, sizing.num_blocks, args.host_bytes)
              + (page_round(slab_bytes) if several else 0) + page_round(loaded.arena_bytes))
    # a second host image (both models' images on the host): flips then move only incoming bytes
    keep_bytes, keep_why = host_copy_bytes(args.flip_host_copies, [m.nbytes for m in models], pinned,
                                           host_available_bytes(), page_round)
    log.info("flip_host_copies", keep_bytes=keep_bytes, why=keep_why)
    pinned += keep_bytes
    mid = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    # restores land layer by layer, so a returning turn's prefill reads each layer as it lands
    mover = Mover(kv, sizing.num_blocks, args.host_bytes, disk_dir, pinned, device, worker=args.worker,
                  disk_bytes=args.disk_bytes, fsync=args.disk_fsync, layered_restores=True)
    # device bytes the mover made besides its pool (index and checksum rows): measured on CUDA only
    scratch = (torch.cuda.memory_allocated(torch.device(device)) - mid - sizing.pool_bytes) if cuda else None
    slab = None
    if several:
        slab = HostSlab(mover.pinned, slab_bytes)
        models[1].sums = store_in_slab(slab, models[1], loaded.host.pop(models[1].name), ring * chunk)
    keep = HostSlab(mover.pinned, keep_bytes, owner="weights-keep") if keep_bytes else None
    core = WorkerCore(mover, args.worker, faults, expected_errors=(DataPlaneError,))
    core.restores = KeptRestores(mover)
    fm = first.model
    graphs = StepGraphs(fm.runner)
    loop = ServingLoop(worker=args.worker, runner=fm.runner, tokenizer=fm.tokenizer, device_pool=mover.device_pool,
                       model_id=first.name, model_digest=fm.kv_digest, page_tokens=args.page_tokens,
                       keys_fn=block_content_keys, max_step_tokens=args.max_step_tokens, max_seqs=MAX_SEQS,
                       graphs=graphs, restores=core.restores)
    arena.add_reader(ServingReader(loop, first))
    # captured once the pool exists, before the first request (every decode batch up to max_seqs),
    # and again at every flip or wake: the graphs read the arena's weights at their addresses
    arena.add_reader(GraphsReader(graphs, first, mover.device_pool, args.page_tokens, MAX_SEQS, capture=True))
    if graphs.graphs is not None:       # they hold the pool's address: a reader, captured again on a rebind
        mover.device_pool.add_reader(graphs)
    core.books = MemoryBooks(args.worker, device, mover.pinned, sizing, model=loop.model_id,
                             weights_bytes=weights_bytes, weights_allocator_bytes=allocator_bytes,
                             scratch_bytes=max(scratch, 0) if scratch is not None else None,
                             graphs_bytes=graphs.graph_bytes)
    graphs.books = core.books           # a capture after start (a rebind, a flip, a wake) updates them
    swapper = WeightsSwapper(worker=args.worker, arena=arena, models=models, slab=slab, budget=mover.pinned,
                             loop=loop, graphs=graphs, pool=mover.device_pool, dtype=dtype, chunk_bytes=chunk,
                             ring_depth=ring, capture_graphs=True, books=core.books, keep=keep, tp=tp,
                             faults=faults)
    swapper.tell_books()
    attach(core, loop, kv.block_bytes, swapper=swapper)
    if spec is not None:
        join_group(core, loop, spec, faults)
    log.info("serving_model_loaded", model=loop.model_id, models=[m.name for m in models], source=fm.source,
             dtype=str(dtype), max_context=loop.max_positions, device_blocks=sizing.num_blocks,
             block_bytes=kv.block_bytes, arena_bytes=weights_bytes, slab_bytes=slab_bytes,
             pool_sizing=sz.explain(sizing))
    return core, kv.block_bytes


def arena_fits(args, meter, arena_bytes: int, largest: str, block_bytes: int, min_blocks: int, reserve: int) -> None:
    """Refuse (StartRefused, with the sizing's arithmetic) a worker whose largest model,
    with the smallest pool, does not fit its share of the device, before the arena is allocated."""
    from residency.dataplane import sizing as sz  # noqa: PLC0415

    total, in_use = meter.measure()
    fraction = args.gpu_memory_fraction or sz.default_fraction(args.device)
    try:
        sz.size_pool(device=args.device, total_bytes=total, in_use_bytes=in_use + arena_bytes, fraction=fraction,
                     reserve_bytes=reserve, weights_bytes=arena_bytes, block_bytes=block_bytes, min_blocks=min_blocks)
    except sz.PoolSizingRefused as e:
        raise sz.StartRefused(f"model {largest} cannot fit on the {args.device} device even alone: its "
                                    f"weights arena is {arena_bytes} B; {e}") from e


def build_offload_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    """A MoE model whose experts live in pinned host memory with device slots (``--expert-budget``,
    docs/moe.md): its weights are not in a flip arena, so it serves one model and no SwapWeights."""
    import torch  # noqa: PLC0415 - seconds of import, only for a worker that serves

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.model import block_content_keys, load_model  # noqa: PLC0415
    from residency.dataplane.model.errors import ModelError  # noqa: PLC0415
    from residency.dataplane.model.expert_policy import parse_expert_budget  # noqa: PLC0415
    from residency.dataplane.model.experts import prepare_offload  # noqa: PLC0415
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415
    from residency.dataplane.weights_models import parse_model_specs  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.restore_pipeline import KeptRestores  # noqa: PLC0415
    from residency.dataplane.serving import ServingLoop  # noqa: PLC0415
    from residency.dataplane.serving_graphs import StepGraphs  # noqa: PLC0415

    from residency.dataplane import sizing as sz  # noqa: PLC0415
    from residency.dataplane.build import pool_sizing  # noqa: PLC0415
    from residency.dataplane.memory_books import MemoryBooks  # noqa: PLC0415

    device = args.device
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    specs = parse_model_specs(args.model, args.served_model_name, model_id_for)
    if len(specs) != 1:
        raise sz.StartRefused(f"--expert-budget serves one model, not {len(specs)}: offloaded experts do not flip")
    path = specs[0].path
    meter = sz.Meter(device)
    cuda = device.startswith("cuda")
    before = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    # loaded on the host: the experts never take device memory beyond their slots
    model = load_model(path, device="cpu", dtype=dtype, max_positions=args.max_context)
    try:
        model, offload = prepare_offload(model, parse_expert_budget(args.expert_budget), device)
    except ModelError as e:         # the server stops with the arithmetic, as for a refused pool
        raise sz.StartRefused(f"--expert-budget {args.expert_budget}: {e}") from e
    weights_bytes = model.runner.w.num_bytes() + offload.slot_bytes
    allocator_bytes = torch.cuda.memory_allocated(torch.device(device)) - before if cuda else None
    c = model.config
    kv = KVLayout(c.num_layers, args.page_tokens, c.num_kv_heads, c.head_dim, dtype=dtype)
    reserve = sz.activation_reserve(device, args.max_step_tokens, c.hidden, c.intermediate, c.vocab_size)
    sizing = pool_sizing(args, meter, kv.block_bytes, weights_bytes,
                         sz.min_blocks_for(model.runner.max_positions, args.page_tokens), reserve)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    pinned = Mover.pinned_bytes_needed(kv, sizing.num_blocks, args.host_bytes)
    mid = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    pinned += offload.host_bytes_needed           # the experts' host copies are pinned under the same budget
    # restores land layer by layer, so a returning turn's prefill reads each layer as it lands
    mover = Mover(kv, sizing.num_blocks, args.host_bytes, disk_dir, pinned, device, worker=args.worker,
                  disk_bytes=args.disk_bytes, fsync=args.disk_fsync, layered_restores=True)
    offload.pin(mover.pinned)
    # device bytes the mover made besides its pool (index and checksum rows): measured on CUDA only
    scratch = (torch.cuda.memory_allocated(torch.device(device)) - mid - sizing.pool_bytes) if cuda else None
    core = WorkerCore(mover, args.worker, faults, expected_errors=(DataPlaneError,))
    # an offloaded MoE layer asks the host which experts it routed to: no graph can replay that
    graphs = StepGraphs(model.runner)
    core.restores = KeptRestores(mover)
    loop = ServingLoop(worker=args.worker, runner=model.runner, tokenizer=model.tokenizer,
                       device_pool=mover.device_pool, model_id=specs[0].name,
                       model_digest=model.kv_digest, page_tokens=args.page_tokens, keys_fn=block_content_keys,
                       max_step_tokens=args.max_step_tokens, max_seqs=MAX_SEQS, graphs=graphs,
                       restores=core.restores)
    attach(core, loop, kv.block_bytes, offload)
    core.books = MemoryBooks(args.worker, device, mover.pinned, sizing, model=loop.model_id,
                             weights_bytes=weights_bytes, weights_allocator_bytes=allocator_bytes,
                             scratch_bytes=max(scratch, 0) if scratch is not None else None,
                             graphs_bytes=graphs.graph_bytes)
    log.info("serving_model_loaded", model=loop.model_id, source=model.source, dtype=str(dtype),
             max_context=loop.max_positions, device_blocks=sizing.num_blocks, block_bytes=kv.block_bytes,
             weights_bytes=weights_bytes, pool_sizing=sz.explain(sizing),
             expert_slots=offload.S)
    return core, kv.block_bytes


def join_group(core: WorkerCore, loop, spec, faults: WorkerFaults) -> None:
    """Make ``loop`` one rank of ``spec``'s group: its steps agreed with the other ranks
    (dataplane/group.py), its Hello naming the group."""
    from residency.dataplane.group import GroupLoop, StepRounds, open_store  # noqa: PLC0415

    store = open_store(spec)
    # a Generate goes through the weights' gate first (gate_requests): one naming a model not on
    # the device is answered at once, alike on every rank (the ranks flip together)
    group = GroupLoop(loop, StepRounds(store, spec.rank, spec.ranks), faults, admit=core.handlers.get(Generate))
    for t in (Generate, CancelGenerate):
        core.register(t, group.handle)
    core.background = (group.has_work, group.step)
    core.group_fields = spec.hello_fields()


def attach(core: WorkerCore, loop, block_bytes: int, offload=None, swapper=None) -> None:
    """Join ``loop`` to ``core``: its commands, its idle work, the move guard, the hello extras.
    ``offload`` (an ExpertOffload): its moves follow each step as one ExpertsMoved, and the
    placement made at start follows the first Hello. ``swapper`` (dataplane/weights_swap.py):
    SwapWeights, and the gate that answers a request for weights that are not on the device."""
    core.register_side(Tokenize, loop.handle)      # pure: rendered and encoded beside the steps
    for t in (Generate, CancelGenerate):
        core.register(t, loop.handle)
    if swapper is not None:
        gate_requests(core, loop, swapper)
    execute, release = core.handlers[ExecuteMove], core.handlers[ReleaseBlocks]

    def guarded_execute(cmd: ExecuteMove) -> list:
        held = loop.holding(cmd.blocks)
        if held:
            return [ev.MoveRejected(move_id=cmd.move_id, worker=core.worker, asked_bytes=len(cmd.blocks) * block_bytes,
                                    blocks=held, reason=f"pages {held[:8]} are in use by a running sequence")]
        return execute(cmd)

    def guarded_release(cmd: ReleaseBlocks) -> list:
        held = loop.holding(cmd.blocks) if cmd.tier == "device" else []
        if held:
            return [CommandFailed(worker=core.worker, ref=cmd.release_id, error="BlockBusy",
                                  detail=f"pages {held[:8]} are in use by a running sequence")]
        return release(cmd)

    core.register(ExecuteMove, guarded_execute)
    core.register(ReleaseBlocks, guarded_release)
    if offload is not None:
        def step() -> list:
            return loop.step() + offload.drain(core.worker, loop.num_steps)
        core.background = (loop.has_work, step)
        core.hello_extras = lambda: [loop.ready(block_bytes)] + offload.drain(core.worker, 0)
    elif swapper is not None:
        core.background = (loop.has_work, loop.step)
        core.hello_extras = lambda: [swapper.ready(loop.ready(block_bytes))]
    else:
        core.background = (loop.has_work, loop.step)
        core.hello_extras = lambda: [loop.ready(block_bytes)]
    core.progress = lambda: (loop.num_steps, len(loop.seqs))    # plain reads: safe off the device thread
    core.serving = loop


def gate_requests(core: WorkerCore, loop, swapper) -> None:
    """SwapWeights on the device thread; a Generate that names a model not on the device (or
    comes while the weights sleep) answered at once with the reason, never held. A Tokenize that
    names a served model runs with that model's own tokenizer whether it is resident or not (it
    needs no weights); one naming no model is gated like a Generate, one naming an unknown model
    gets ``model_unknown``."""
    core.register(SwapWeights, swapper.handle)
    core.closers.append(swapper.close)

    from residency.dataplane.weights_swap import ModelTokenizer  # noqa: PLC0415

    own = {name: ModelTokenizer(loop, e) for name, e in swapper.models.items()}

    def tokenize(msg: Tokenize) -> list:
        if msg.model in own:        # needs no weights: that model's tokenizer, resident or not
            return [own[msg.model].tokenize(msg)]
        with swapper.lock:          # the resident model must not change while its tokenizer runs
            why = swapper.gate(msg.model)
            if why is None:
                return loop.handle(msg)
        return [Tokenized(request_id=msg.request_id, worker=core.worker, token_ids=[], keys=[], error=why)]

    def generate(cmd: Generate) -> list:
        why = swapper.gate(cmd.model)
        if why is None:
            return loop.handle(cmd)
        first_new = 0 if cmd.copy_from else cmd.num_cached_tokens // loop.page
        return [TokensGenerated(request_id=cmd.request_id, worker=core.worker, token_ids=[], text="",
                                finish_reason="error", error=why, num_prompt_tokens=len(cmd.token_ids),
                                blocks_unused=list(cmd.block_ids[first_new:]))]

    core.register_side(Tokenize, tokenize)
    core.register(Generate, generate)


__all__ = ["add_serving_args", "build_serving_core", "attach", "gate_requests", "model_id_for"]
