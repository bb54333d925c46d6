"""Move executors: one class per route, each taking a validated plan and returning an outcome.

    route              kinds                    executor
    device -> host     spill, evict, park       SpillToHost
    host   -> device   restore                  RestoreFromHost
    device -> disk     spill, evict, park       SpillToDisk
    disk   -> device   restore                  RestoreFromDisk
    host   -> disk     demote                   Demote
    disk   -> host     promote                  Promote

A serving worker's mover lands restores layer by layer instead (``Mover.LAYERED``): RestoreByLayer
from the host (moves/layered.py), RestoreFromDiskByLayer from disk (moves/layered_disk.py).
"""
from residency.dataplane.moves.base import Hasher, InFlight, MoveContext
from residency.dataplane.moves.copy import COPY_MODES, Copier, coalesce
from residency.dataplane.moves.device_host import PRIME_CHUNKS, RestoreFromHost, SpillToHost
from residency.dataplane.moves.disk_routes import Demote, Promote, RestoreFromDisk, SpillToDisk
from residency.dataplane.moves.indexes import IndexUploader, SumsLanding
from residency.dataplane.moves.plan import FREES_SOURCE, ROUTES, MovePlan, validate
from residency.dataplane.moves.staging import DeviceStaging, StagingRing
from residency.dataplane.moves.streams import CopyStreams, Done

EXECUTORS: dict[tuple[str, str], type[InFlight]] = {
    cls.route: cls for cls in (SpillToHost, RestoreFromHost, SpillToDisk, RestoreFromDisk, Demote, Promote)
}

__all__ = [
    "EXECUTORS", "PRIME_CHUNKS", "ROUTES", "FREES_SOURCE", "COPY_MODES", "MovePlan", "validate", "MoveContext",
    "InFlight", "Hasher", "Copier", "coalesce", "IndexUploader", "SumsLanding", "StagingRing", "DeviceStaging", "CopyStreams", "Done",
    "SpillToHost", "RestoreFromHost", "SpillToDisk", "RestoreFromDisk", "Demote", "Promote",
]
