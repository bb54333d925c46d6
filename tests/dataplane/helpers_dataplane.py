"""Small movers and commands for the data-plane tests (irregular layout, random bytes)."""
from __future__ import annotations

import torch

from residency.dataplane.mover import Mover
from residency.dataplane.moves.dma import TorchDma
from residency.dataplane.pools import KVLayout
from residency.events.commands import CommitBlocks, ExecuteMove, ReleaseBlocks

# 3 layers x K/V x 5 tokens x 2 heads x 6 dims, bf16: 720 bytes = 180 words per block.
LAYOUT = KVLayout(num_layers=3, page_tokens=5, num_kv_heads=2, head_dim=6, dtype=torch.bfloat16)
MOVER_DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


class BatchedTorchDma(TorchDma):
    """Torch's copies, said to go in batches: a mover given it copies by plain DMAs ("dma"), the
    path a GPU with cudaMemcpyBatchAsync takes, here on any device."""
    batched = True


def make_mover(disk_dir, device="cpu", device_blocks=12, host_blocks=10, disk_blocks=16, layout=LAYOUT,
                budget_slack=0, **kw) -> Mover:
    host_bytes = host_blocks * layout.block_bytes
    need = Mover.pinned_bytes_needed(layout, device_blocks, host_bytes)
    return Mover(layout, device_blocks, host_bytes, disk_dir, need + budget_slack, device=device,
                  disk_bytes=None if disk_blocks is None else disk_blocks * layout.block_bytes,
                  fsync=False, **kw)


_n = [0]


def move(kind, src, dst, blocks, keep_source=None, move_id=None, deadline_ns=0) -> ExecuteMove:
    if keep_source is None:
        keep_source = kind in ("spill", "promote", "demote")
    _n[0] += 1
    return ExecuteMove(move_id=move_id or f"m{_n[0]}", kind=kind, src=src, dst=dst, blocks=list(blocks),
                       keep_source=keep_source, deadline_ns=deadline_ns)


def commit(mover, tier, blocks, seed=None) -> dict[int, torch.Tensor]:
    """Commit blocks with random bytes; returns block -> its words (on CPU) for later comparison."""
    seed = seed if seed is not None else int(torch.randint(0, 1 << 62, (1,)))
    mover.commit_blocks(CommitBlocks(request_id=f"c{seed}", session=None, tier=tier, blocks=list(blocks), seed=seed))
    return {b: words_of(mover, tier, b) for b in blocks}


def release(mover, tier, blocks, release_id="r"):
    return mover.release(ReleaseBlocks(release_id=release_id, tier=tier, blocks=list(blocks)))


def words_of(mover, tier, block) -> torch.Tensor:
    """The bytes of one copy as int32 words on the CPU."""
    if tier == "device":
        return mover.device_pool.words[mover.device_pool.slot_of(block)].cpu().clone()
    if tier == "host":
        return mover.host_pool.words[mover.host_pool.slot_of(block)].clone()
    buf = torch.empty(mover.layout.block_words, dtype=torch.int32)
    mover.disk_tier.read_into(block, buf)
    return buf


def snapshot(mover):
    """Everything a failed or rejected move must leave unchanged (bookkeeping and resident bytes)."""
    out = {}
    for tier in ("device", "host"):
        t = mover.pool(tier).table
        out[tier] = (dict(t._slot), sorted(t._free), dict(t._refs), set(t._reserved))
        out[tier + "-bytes"] = {b: words_of(mover, tier, b) for b in t.ready_blocks()}
    out["host-checksums"] = dict(mover.host_pool._checksums)
    out["disk"] = (dict(mover.disk_tier._index), dict(mover.disk_tier._reserved))
    out["usage"] = mover.usage()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("-bytes"):
            assert a[k].keys() == b[k].keys(), k
            for blk in a[k]:
                assert torch.equal(a[k][blk], b[k][blk]), f"{k} block {blk} changed"
        else:
            assert a[k] == b[k], k


def moved_off_device(mover, blocks, to: str):
    """Fresh random pages of ``blocks`` committed on the device, evicted to ``to`` ("host" or
    "disk"); the device slots a restore will claim then hold another random pattern (never zeros:
    stale bytes there would pass for landed ones). -> the pages' words."""
    import torch  # noqa: PLC0415

    from residency.events.catalog import MoveAcked  # noqa: PLC0415

    data = commit(mover, "device", blocks)
    assert isinstance(mover.execute(move("evict", "device", to, blocks)), MoveAcked)
    mover.device_pool.words.copy_(torch.randint(-2**31, 2**31 - 1, mover.device_pool.words.shape,
                                                dtype=torch.int32).to(mover.device_pool.words.device))
    return data
