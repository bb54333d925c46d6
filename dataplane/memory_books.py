"""What a worker tells the control about its memory beyond the KV blocks: how the device pool was
sized, the device bytes held outside it (the weights, scratch), every pinned grant, and a probe
of the driver, the allocator and the host when asked (``QueryMemory``).

    Hello           pinned (owner -> bytes), device_owned, model, sizing: a snapshot
    after Hello     each grant made or given back ─► PinnedChanged (the I/O thread sends them)
    QueryMemory     ─► MemoryReport, read from counters on the I/O thread (None where unreadable)

The pinned budget calls ``on_grant`` from the device thread (a resize grows index buffers);
the I/O thread takes the changes, so a lock guards the queue and the snapshot together: a
change is either in a Hello's snapshot or in a PinnedChanged after it, never both, never neither.
"""
from __future__ import annotations

import threading

from residency.events.commands import MemoryReport, PinnedChanged, PoolSizing


class MemoryBooks:
    def __init__(self, worker: int, device: str, pinned_budget, sizing: PoolSizing | None, *,
                 model: str = "", weights_bytes: int = 0, weights_allocator_bytes: int | None = None,
                 scratch_bytes: int | None = None, graphs_bytes: int | None = None):
        self.worker, self.device = worker, device
        self.budget = pinned_budget
        self.sizing = sizing
        self.model = model
        self.weights_bytes = weights_bytes
        self.weights_allocator_bytes = weights_allocator_bytes
        self.device_owned = {"weights": weights_bytes} if weights_bytes else {}
        if scratch_bytes:
            self.device_owned["scratch"] = scratch_bytes
        # the resident model's image by tier and its checksum (hex; "" not taken), for WeightsLoaded
        self.weights_tier_bytes: dict[str, int] = {}
        self.weights_checksum = ""
        # captured decode graphs' memory pool, as measured at capture; no key: not measured (CPU,
        # or none captured), which the memory view shows as None, never 0
        if graphs_bytes is not None:
            self.device_owned["graphs"] = graphs_bytes
        self._lock = threading.Lock()
        self._changes: list[PinnedChanged] = []
        self._said_hello = False
        if pinned_budget is not None:
            pinned_budget.listener = self.on_grant

    def set_weights(self, model: str, device_bytes: int, tier_bytes: dict[str, int], checksum: str) -> None:
        """The weights arena changed (a flip, a sleep, a wake: dataplane/weights_swap.py): what the
        next Hello and probe say. The device thread; read under the lock."""
        with self._lock:
            self.model = model
            self.device_owned["weights"] = device_bytes
            self.weights_tier_bytes, self.weights_checksum = dict(tier_bytes), checksum

    def set_graphs(self, nbytes: int | None) -> None:
        """The decode graphs were captured again (a pool rebind, a flip, a wake: StepGraphs) or
        dropped: what the next probe says. ``None``: none captured or not measured, so the key
        goes (the view shows None, never a stale figure or a 0 nobody measured). Any thread."""
        with self._lock:
            if nbytes is None:
                self.device_owned.pop("graphs", None)
            else:
                self.device_owned["graphs"] = nbytes

    # ------------------------------------------------------------ pinned grants
    def on_grant(self, owner: str, nbytes: int, registered: bool) -> None:
        """The budget made (or gave back) a grant. Any thread."""
        with self._lock:
            if self._said_hello:
                self._changes.append(PinnedChanged(worker=self.worker, owner=owner, bytes=nbytes,
                                                   registered=registered))

    def pinned_by_owner(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.budget is not None:
            for g in self.budget.grants():
                out[g.owner] = out.get(g.owner, 0) + g.bytes
        return out

    def hello_fields(self) -> dict:
        """Hello's memory fields; from now on grants travel as PinnedChanged."""
        with self._lock:
            self._changes.clear()        # in this snapshot
            self._said_hello = True
            return dict(pinned=self.pinned_by_owner(), device_owned=dict(self.device_owned), model=self.model,
                        weights_allocator_bytes=self.weights_allocator_bytes, sizing=self.sizing,
                        pinned_limit_bytes=self.budget.limit_bytes if self.budget is not None else None,
                        weights_tier_bytes=dict(self.weights_tier_bytes), weights_checksum=self.weights_checksum)

    def take_changes(self) -> list[PinnedChanged]:
        with self._lock:
            out, self._changes = self._changes, []
            return out

    # ------------------------------------------------------------ the probe
    def probe(self, nonce: int) -> MemoryReport:
        total = free = allocated = reserved = None
        try:
            if self.device.startswith("cuda"):
                import torch  # noqa: PLC0415

                dev = torch.device(self.device)
                free, total = (int(x) for x in torch.cuda.mem_get_info(dev))
                allocated, reserved = int(torch.cuda.memory_allocated(dev)), int(torch.cuda.memory_reserved(dev))
            else:
                from residency.dataplane.sizing import meminfo  # noqa: PLC0415

                info = meminfo()
                total, free = info.get("MemTotal"), info.get("MemAvailable")
        except Exception:  # noqa: BLE001 - an unreadable counter is reported unknown (None), not 0
            pass
        in_use = limit = None
        if self.budget is not None:
            in_use, limit = self.budget.in_use_bytes, self.budget.limit_bytes
        with self._lock:
            owned = dict(self.device_owned)
        return MemoryReport(worker=self.worker, nonce=nonce, device_total_bytes=total, device_free_bytes=free,
                            allocator_allocated_bytes=allocated, allocator_reserved_bytes=reserved,
                            pinned_in_use_bytes=in_use, pinned_limit_bytes=limit, device_owned=owned)

