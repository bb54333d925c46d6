"""The data plane's one exception tree.

Everything a pool, a move executor or the mover raises derives from ``DataPlaneError``. An
expected "no" (no room, not resident, over the pinned budget) carries its numbers as
attributes and in its message; the mover turns those into ``MoveRejected`` values.
"""
from __future__ import annotations


class DataPlaneError(Exception):
    """Root of every error raised by dataplane.pools, dataplane.moves and dataplane.mover."""


class LayoutError(DataPlaneError):
    """A KVLayout or pool configuration that cannot be built."""


class IntegrityError(DataPlaneError):
    """``check_integrity()`` found a broken invariant; the message carries the actual numbers."""


class NoRoom(DataPlaneError):
    """A tier cannot take ``asked_bytes``; ``available_bytes`` is what it has free."""

    def __init__(self, tier: str, asked_bytes: int, available_bytes: int, detail: str = ""):
        self.tier = tier
        self.asked_bytes = asked_bytes
        self.available_bytes = available_bytes
        msg = f"{tier} has no room: asked {asked_bytes} bytes, available {available_bytes} bytes"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class BlockStateError(DataPlaneError):
    """A block is not in the state an operation needs; ``blocks`` names them."""

    def __init__(self, tier: str, blocks: list[int], what: str):
        self.tier = tier
        self.blocks = list(blocks)
        shown = self.blocks[:16]
        more = f" (+{len(self.blocks) - 16} more)" if len(self.blocks) > 16 else ""
        super().__init__(f"{what} on {tier}: blocks {shown}{more}")


class NotResident(BlockStateError):
    def __init__(self, tier: str, blocks: list[int]):
        super().__init__(tier, blocks, "not resident")


class AlreadyResident(BlockStateError):
    def __init__(self, tier: str, blocks: list[int]):
        super().__init__(tier, blocks, "already resident")


class BlockNotReady(BlockStateError):
    """The block has a slot, but its bytes are still arriving (restore not verified yet)."""

    def __init__(self, tier: str, blocks: list[int]):
        super().__init__(tier, blocks, "not ready (copy in flight, unverified)")


class BlockBusy(BlockStateError):
    """The block is part of a move in flight; it cannot be released or moved again until that ends."""

    def __init__(self, tier: str, blocks: list[int]):
        super().__init__(tier, blocks, "busy in a move in flight")


class ResizeRefused(DataPlaneError):
    """A pool resize the worker declines, with its arithmetic; nothing changed.

    ``asked_slots``/``asked_bytes``: the size asked; ``live_blocks``: blocks the pool holds (the
    worker never drops one); ``available_bytes``: what the machine has free for the new tensor
    (None where memory was not the reason)."""

    def __init__(self, tier: str, reason: str, *, asked_slots: int, asked_bytes: int, live_blocks: int,
                 available_bytes: int | None = None):
        self.tier = tier
        self.reason = reason
        self.asked_slots = asked_slots
        self.asked_bytes = asked_bytes
        self.live_blocks = live_blocks
        self.available_bytes = available_bytes
        super().__init__(f"{tier} resize to {asked_slots} slots refused: {reason}")


class ReaderRefused(DataPlaneError):
    """A reader of a pool that cannot bind to it (another shape, dtype or device), named."""

    def __init__(self, reader: str, why: str):
        self.reader = reader
        self.why = why
        super().__init__(f"reader {reader} refuses to bind: {why}")


class TornPool(DataPlaneError):
    """A pool some of whose readers do not carry its generation: nothing may read or write it
    until a complete rebind repairs it. ``behind``: reader -> the generation it carries."""

    def __init__(self, tier: str, gen: int, behind: dict[str, int], user: str):
        self.tier = tier
        self.gen = gen
        self.behind = dict(behind)
        self.user = user
        shown = ", ".join(f"{r} at gen {g}" for r, g in sorted(self.behind.items()))
        super().__init__(f"torn pool: {tier} pool at gen {gen} has readers behind ({shown}); "
                         f"{user} refuses to use it until a complete rebind")


class PinnedBudgetExceeded(DataPlaneError):
    """A pinned-host allocation the budget refused, with its arithmetic."""

    def __init__(self, owner: str, asked_bytes: int, available_bytes: int, limit_bytes: int, in_use_bytes: int):
        self.owner = owner
        self.asked_bytes = asked_bytes
        self.available_bytes = available_bytes
        self.limit_bytes = limit_bytes
        self.in_use_bytes = in_use_bytes
        super().__init__(
            f"pinned budget refuses {owner}: asked {asked_bytes} bytes, available {available_bytes} "
            f"= limit {limit_bytes} - in use {in_use_bytes}"
        )


class PinningFailed(DataPlaneError):
    """Page-locking host memory failed; we never fall back to pageable memory silently."""


class DiskCopyError(DataPlaneError):
    """A disk block file that is missing, truncated, or not what its name says."""

    def __init__(self, block_id: int, path: str, reason: str):
        self.block_id = block_id
        self.path = path
        self.reason = reason
        super().__init__(f"disk copy of block {block_id} {reason}: {path}")


class ChecksumMismatch(DataPlaneError):
    """Bytes that do not hash to the checksum recorded for them; ``blocks`` names them."""

    def __init__(self, where: str, mismatches: list[tuple[int, int, int]]):
        self.where = where
        self.blocks = [b for b, _, _ in mismatches]
        self.mismatches = mismatches
        shown = ", ".join(f"block {b}: expected {e:#018x} got {g:#018x}" for b, e, g in mismatches[:4])
        more = f" (+{len(mismatches) - 4} more)" if len(mismatches) > 4 else ""
        super().__init__(f"checksum mismatch on {where}: {shown}{more}")
