"""Memory of one data-plane worker: the device KV pool, the pinned host pool, the disk tier,
and the pinned-host budget that every page-locked allocation is registered with first."""
from dataplane.pools.budget import PinnedBudget, PinnedBuffer, PinnedGrant
from dataplane.pools.device import DevicePool
from dataplane.pools.disk import DiskTier, RebuildReport
from dataplane.pools.errors import (
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
)
from dataplane.pools.host import HostPool
from dataplane.pools.layout import KVLayout
from dataplane.pools.slots import SlotTable

__all__ = [
    "KVLayout", "SlotTable", "DevicePool", "HostPool", "DiskTier", "RebuildReport",
    "PinnedBudget", "PinnedBuffer", "PinnedGrant",
    "DataPlaneError", "LayoutError", "IntegrityError", "NoRoom", "BlockStateError", "NotResident",
    "AlreadyResident", "BlockNotReady", "BlockBusy", "PinnedBudgetExceeded", "PinningFailed",
    "DiskCopyError", "ChecksumMismatch",
]
