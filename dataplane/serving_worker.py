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
from residency.events.commands import CancelGenerate, CommandFailed, ExecuteMove, Generate, ReleaseBlocks, Tokenize

log = structlog.get_logger("dataplane.serving")
DTYPES = ("bfloat16", "float16", "float32")
MAX_SEQS = 64          # sequences one step batches (and the largest decode graph captured)


def add_serving_args(p) -> None:
    g = p.add_argument_group("serving (with --model)")
    g.add_argument("--model", default=None, help="a GGUF file, a Hugging Face directory, or 'embedded' (SmolLM2)")
    g.add_argument("--served-model-name", default=None, help="the model id clients name (default: from the file)")
    g.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--page-tokens", type=int, default=16)
    g.add_argument("--max-step-tokens", type=int, default=256, help="new tokens per forward step (prefill chunking)")
    g.add_argument("--max-context", type=int, default=None, help="cap the model's context window")
    g.add_argument("--expert-budget", default=None, metavar="FRACTION|BYTES",
                   help="a MoE model: device bytes for its experts (50%%, 0.25 or 6GiB); the rest stay in pinned "
                        "host memory and are fetched when routed to (docs/moe.md)")


def model_id_for(path: str | None) -> str:
    if not path or path == "embedded":
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(path))
    if name.lower().endswith(".gguf"):
        name = name[:-5]
        name = re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name


def build_serving_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    import torch  # noqa: PLC0415 - seconds of import, only for a worker that serves

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.model import block_content_keys, load_model  # noqa: PLC0415
    from residency.dataplane.model.tp import TensorParallel, TensorParallelRefused, init_group  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.serving import ServingLoop  # noqa: PLC0415
    from residency.dataplane.serving_graphs import StepGraphs, graph_table_width  # noqa: PLC0415

    from residency.dataplane import sizing as sz  # noqa: PLC0415
    from residency.dataplane.build import pool_sizing  # noqa: PLC0415
    from residency.dataplane.memory_books import MemoryBooks  # noqa: PLC0415

    device = args.device
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    path = None if args.model in (None, "", "embedded") else args.model
    meter = sz.Meter(device)
    cuda = device.startswith("cuda")
    before = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    spec = group_spec(args)
    tp = TensorParallel(spec.rank, spec.ranks) if spec is not None else None
    offload = None
    if getattr(args, "expert_budget", None):
        from residency.dataplane.model.expert_policy import parse_expert_budget  # noqa: PLC0415
        from residency.dataplane.model.experts import prepare_offload  # noqa: PLC0415

        from residency.dataplane.model.errors import ModelError  # noqa: PLC0415

        if spec is not None:
            raise GroupRefused(f"--tp {spec.ranks}: --expert-budget offloads a mixture-of-experts model, which is "
                               "not split over ranks")
        # loaded on the host: the experts never take device memory beyond their slots
        model = load_model(path, device="cpu", dtype=dtype, max_positions=args.max_context)
        try:
            model, offload = prepare_offload(model, parse_expert_budget(args.expert_budget), device)
        except ModelError as e:         # the server stops with the arithmetic, as for a refused pool
            raise sz.StartRefused(f"--expert-budget {args.expert_budget}: {e}") from e
    else:
        try:   # a model that does not split is refused before a weight is read or a peer met
            model = load_model(path, device=device, dtype=dtype, max_positions=args.max_context, tp=tp)
        except TensorParallelRefused as e:
            raise GroupRefused(f"--tp {spec.ranks}: {e}") from None
    if spec is not None:     # before the graphs: their capture runs the step's collectives
        init_group(spec.rank, spec.ranks, spec.init, device=device, timeout_s=RENDEZVOUS_S)
    weights_bytes = model.runner.w.num_bytes() + (offload.slot_bytes if offload is not None else 0)
    allocator_bytes = torch.cuda.memory_allocated(torch.device(device)) - before if cuda else None
    c = model.config
    kv = KVLayout(c.num_layers, args.page_tokens, c.num_kv_heads, c.head_dim, dtype=dtype)
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415

    reserve = sz.activation_reserve(device, args.max_step_tokens, c.hidden, c.intermediate, c.vocab_size)
    sizing = pool_sizing(args, meter, kv.block_bytes, weights_bytes,
                         sz.min_blocks_for(model.runner.max_positions, args.page_tokens), reserve)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    pinned = Mover.pinned_bytes_needed(kv, sizing.num_blocks, args.host_bytes)
    mid = torch.cuda.memory_allocated(torch.device(device)) if cuda else None
    if offload is not None:
        pinned += offload.host_bytes_needed       # the experts' host copies are pinned under the same budget
    mover = Mover(kv, sizing.num_blocks, args.host_bytes, disk_dir, pinned, device, worker=args.worker,
                    disk_bytes=args.disk_bytes, fsync=args.disk_fsync)
    if offload is not None:
        offload.pin(mover.pinned)
    # device bytes the mover made besides its pool (index and checksum rows): measured on CUDA only
    scratch = (torch.cuda.memory_allocated(torch.device(device)) - mid - sizing.pool_bytes) if cuda else None
    core = WorkerCore(mover, args.worker, faults, expected_errors=(DataPlaneError,))
    # captured once the pool exists, before the first request: every decode batch up to max_seqs
    # an offloaded MoE layer asks the host which experts it routed to: no graph can replay that
    try:
        graphs = StepGraphs(model.runner) if offload is not None else StepGraphs.capture(
            model.runner, mover.device_pool.tensor, max_seqs=MAX_SEQS,
            max_blocks_per_seq=graph_table_width(model.runner.max_positions, args.page_tokens))
    except Exception as e:  # noqa: BLE001 - only a group's rank: graphs whose capture holds collectives
        if spec is None:
            raise
        # NOTE: every rank captures the same sizes in the same order (their collectives pair up);
        # one that fails runs eagerly, which issues the same collectives in the same order
        log.warning("decode_graphs_not_captured", rank=spec.rank, error=repr(e))
        graphs = StepGraphs(model.runner)
    loop = ServingLoop(worker=args.worker, runner=model.runner, tokenizer=model.tokenizer,
                       device_pool=mover.device_pool, model_id=args.served_model_name or model_id_for(args.model),
                       model_digest=model.kv_digest, page_tokens=args.page_tokens, keys_fn=block_content_keys,
                       max_step_tokens=args.max_step_tokens, max_seqs=MAX_SEQS, graphs=graphs)
    if graphs.graphs is not None:       # they hold the pool's address: a reader, captured again on a rebind
        mover.device_pool.add_reader(graphs)
    attach(core, loop, kv.block_bytes, offload)
    if spec is not None:
        join_group(core, loop, spec, faults)
    core.books = MemoryBooks(args.worker, device, mover.pinned, sizing, model=loop.model_id,
                             weights_bytes=weights_bytes, weights_allocator_bytes=allocator_bytes,
                             scratch_bytes=max(scratch, 0) if scratch is not None else None)
    log.info("serving_model_loaded", model=loop.model_id, source=model.source, dtype=str(dtype),
             max_context=loop.max_positions, device_blocks=sizing.num_blocks, block_bytes=kv.block_bytes,
             weights_bytes=weights_bytes, pool_sizing=sz.explain(sizing),
             expert_slots=offload.S if offload is not None else None)
    return core, kv.block_bytes


def join_group(core: WorkerCore, loop, spec, faults: WorkerFaults) -> None:
    """Make ``loop`` one rank of ``spec``'s group: its steps agreed with the other ranks
    (dataplane/group.py), its Hello naming the group."""
    from residency.dataplane.group import GroupLoop, StepRounds, open_store  # noqa: PLC0415

    store = open_store(spec)
    group = GroupLoop(loop, StepRounds(store, spec.rank, spec.ranks), faults)
    for t in (Generate, CancelGenerate):
        core.register(t, group.handle)
    core.background = (group.has_work, group.step)
    core.group_fields = spec.hello_fields()


def attach(core: WorkerCore, loop, block_bytes: int, offload=None) -> None:
    """Join ``loop`` to ``core``: its commands, its idle work, the move guard, the hello extras.
    ``offload`` (an ExpertOffload): its moves follow each step as one ExpertsMoved, and the
    placement made at start follows the first Hello."""
    core.register_side(Tokenize, loop.handle)      # pure: rendered and encoded beside the steps
    for t in (Generate, CancelGenerate):
        core.register(t, loop.handle)
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
    if offload is None:
        core.background = (loop.has_work, loop.step)
        core.hello_extras = lambda: [loop.ready(block_bytes)]
    else:
        def step() -> list:
            return loop.step() + offload.drain(core.worker, loop.num_steps)
        core.background = (loop.has_work, step)
        core.hello_extras = lambda: [loop.ready(block_bytes)] + offload.drain(core.worker, 0)
    core.progress = lambda: (loop.num_steps, len(loop.seqs))    # plain reads: safe off the device thread
    core.serving = loop


__all__ = ["add_serving_args", "build_serving_core", "attach", "model_id_for"]
