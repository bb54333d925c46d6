"""Building a worker's core from its command line: the KV layout, the mover, or the model (serving)."""
from __future__ import annotations

from residency.dataplane.faults import WorkerFaults
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


def build_core(args, faults: WorkerFaults) -> tuple[WorkerCore, int]:
    """The worker's core and its block size: a model's (``--model``), else the tier mover's of ``--kv-layout``."""
    if getattr(args, "model", None) not in (None, "", "none"):
        from residency.dataplane.serving_worker import build_serving_core  # noqa: PLC0415 - the model sets the layout
        return build_serving_core(args, faults)
    import torch  # noqa: PLC0415 - seconds of import, only once the worker knows it needs it

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.pools import DataPlaneError, KVLayout  # noqa: PLC0415
    from residency.dataplane.pools.disk import worker_disk_dir  # noqa: PLC0415

    layout = parse_layout(args.kv_layout)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    disk_dir = worker_disk_dir(args.run_dir, args.worker, args.keep_disk)
    kv = KVLayout(*layout[:4], dtype=layout[4])
    pinned = Mover.pinned_bytes_needed(kv, args.device_blocks, args.host_bytes)
    mover = Mover(kv, args.device_blocks, args.host_bytes, disk_dir, pinned, args.device, worker=args.worker,
                  disk_bytes=args.disk_bytes, fsync=args.disk_fsync)
    return WorkerCore(mover, args.worker, faults, expected_errors=(DataPlaneError,)), kv.block_bytes
