"""Memory of one data-plane worker: the device KV pool, the pinned host pool, the disk tier,
and the pinned-host budget that every page-locked allocation is registered with first."""
from residency.dataplane.pools.budget import PinnedBudget, PinnedBuffer, PinnedGrant
from residency.dataplane.pools.device import DevicePool
from residency.dataplane.pools.disk import DiskTier, RebuildReport
from residency.dataplane.pools.errors import (
    AlreadyResident,
    BlockBusy,
    BlockNotReady,
    BlockStateError,
    ChecksumMismatch,
    DataPlaneError,
    DiskCopyError,
    IntegrityError,
    LayoutError,
    NoRoom,
    NotResident,
    PinnedBudgetExceeded,
    PinningFailed,
    ReaderRefused,
    ResizeRefused,
    TornPool,
)
from residency.dataplane.pools.host import HostPool
from residency.dataplane.pools.layout import KVLayout
from residency.dataplane.pools.slots import SlotTable

__all__ = [
    "KVLayout", "SlotTable", "DevicePool", "HostPool", "DiskTier", "RebuildReport",
    "PinnedBudget", "PinnedBuffer", "PinnedGrant",
    "DataPlaneError", "LayoutError", "IntegrityError", "NoRoom", "BlockStateError", "NotResident",
    "AlreadyResident", "BlockNotReady", "BlockBusy", "PinnedBudgetExceeded", "PinningFailed",
    "DiskCopyError", "ChecksumMismatch", "ResizeRefused", "ReaderRefused", "TornPool",
]
