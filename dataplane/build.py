"""Building a worker's core from its command line: the KV layout, the mover, or the model (serving)."""
from __future__ import annotations

from residency.dataplane import sizing as sz
from residency.events.commands import PoolSizing
from residency.dataplane.faults import WorkerFaults
from residency.dataplane.memory_books import MemoryBooks
from residency.dataplane.worker import WorkerCore

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_layout(spec: str) -> tuple[int, int, int, int, str]:
    """"num_layers,page_tokens,num_kv_heads,head_dim,dtype", e.g. "30,16,3,64,bfloat16"."""
    parts = spec.split(",")
    if len(parts) != 5 or parts[4] not in DTYPE_BYTES:
        raise ValueError(f"--kv-layout {spec!r}: want num_layers,page_tokens,num_kv_heads,head_dim,dtype "
                         f"(dtype one of {sorted(DTYPE_BYTES)})")
    return int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4]


def layout_block_bytes(layout: tuple[int, int, int, int, str]) -> int:
    layers, page, heads, dim, dtype = layout
    return layers * 2 * page * heads * dim * DTYPE_BYTES[dtype]


def pool_sizing(args, meter: sz.Meter, block_bytes: int, weights_bytes: int, min_blocks: int,
                reserve_bytes: int) -> PoolSizing:
    """``--device-blocks`` as given, else measured (``meter``, after the weights load) and sized
    from ``--gpu-memory-fraction``; raises PoolSizingRefused with the arithmetic."""
    if args.device_blocks is not None:
        return sz.explicit(args.device, args.device_blocks, block_bytes, weights_bytes)
    total, in_use = meter.measure()
    fraction = args.gpu_memory_fraction or sz.default_fraction(args.device)
    return sz.size_pool(device=args.device, total_bytes=total, in_use_bytes=in_use, fraction=fraction,
                        reserve_bytes=reserve_bytes, weights_bytes=weights_bytes, block_bytes=block_bytes,
                        min_blocks=min_blocks)


def _serves(model) -> bool:
    """``--model`` (repeated: a list) names at least one model ('none' and '' name none)."""
    values = [model] if isinstance(model, str) else list(model or [])
    return any(v not in ("", "none") for v in values)


def build_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    """The worker's core and its block size: a model's (``--model``), else the tier mover's of ``--kv-layout``."""
    if _serves(getattr(args, "model", None)):
        from residency.dataplane.serving_worker import build_serving_core  # noqa: PLC0415 - the model sets the layout
        return build_serving_core(args, faults)
    import torch  # noqa: PLC0415 - seconds of import, only once the worker knows it needs it

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415

    meter = sz.Meter(args.device)
    layout = parse_layout(args.kv_layout)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    kv = KVLayout(*layout[:4], dtype=layout[4])
    sizing = pool_sizing(args, meter, kv.block_bytes, 0, sz.MIN_BLOCKS_NO_MODEL,
                         sz.activation_reserve(args.device, 0))
    pinned = Mover.pinned_bytes_needed(kv, sizing.num_blocks, args.host_bytes)
    mover = Mover(kv, sizing.num_blocks, args.host_bytes, disk_dir, pinned, args.device, worker=args.worker,
                  disk_bytes=args.disk_bytes, fsync=args.disk_fsync)
    core = WorkerCore(mover, args.worker, faults, expected_errors=(DataPlaneError,))
    core.books = MemoryBooks(args.worker, args.device, mover.pinned, sizing)
    return core, kv.block_bytes
