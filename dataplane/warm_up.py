"""A worker's first moves, made on scratch blocks before any command.

On a GPU the first move of a process otherwise compiles (or loads) its Triton kernels: a tenth
of a second or more, on the first command's clock.
"""
from __future__ import annotations

import time

import torch

from residency.dataplane.pools import DataPlaneError
from residency.events.catalog import MoveAcked
from residency.events.commands import CommitBlocks, ExecuteMove

WARM_UP_IDS_FROM = 1 << 62          # block ids no caller uses: [2^62, 2^62 + n)


def warm_up(mover) -> dict:
    """A 1-block spill and restore (the first chunk alone) and, room allowing, one a pipeline
    chunk longer than the first (every chunked kernel), then free them. Leaves no block, slot,
    reservation or checksum behind (the outcomes of its moves stay in the mover's record under
    ``warm-up-*`` ids, never reported). Returns what it did and how long it took."""
    t0 = time.perf_counter()
    room = min(mover.device_pool.table.num_free, mover.host_pool.table.num_free)
    sizes = [n for n in (1, mover.ctx.pipeline_blocks + 1) if n <= room]
    for k, n in enumerate(sizes):
        ids = list(range(WARM_UP_IDS_FROM, WARM_UP_IDS_FROM + n))
        mover.commit_blocks(CommitBlocks(request_id=f"warm-up-{k}", session=None, tier="device", blocks=ids, seed=k))
        try:
            for step, (kind, src, dst) in enumerate((("evict", "device", "host"), ("restore", "host", "device"))):
                out = mover.execute(ExecuteMove(move_id=f"warm-up-{k}-{step}", kind=kind, src=src, dst=dst,
                                                blocks=ids, keep_source=False,
                                                deadline_ns=mover.clock() + 600 * 10**9))
                if not isinstance(out, MoveAcked):
                    raise DataPlaneError(f"warm-up {kind} of {n} blocks: {out}")
        finally:
            for tier in ("device", "host"):
                held = [b for b in ids if mover.pool(tier).holds(b)]
                if held:
                    mover.pool(tier).free(held)
    if mover.torch_device.type == "cuda":
        torch.cuda.synchronize(mover.torch_device)
    return {"blocks": sizes, "seconds": time.perf_counter() - t0}
