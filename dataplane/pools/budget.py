"""The pinned-host budget: the one authority for page-locked RAM in a worker process.

Page-locked memory is taken from the OS for good (it cannot be swapped or reclaimed), so a worker
that pins casually starves its host. Every pinned allocation of the data plane (the host pool,
staging rings, read buffers, index scratch) is **registered here before it is made**; an
allocation the budget cannot fund is refused with its arithmetic (``PinnedBudgetExceeded``:
asked, available = limit - in use) and nothing is allocated.

How memory is pinned: an anonymous page-aligned mapping (mmap) of its own, registered with
``cudaHostRegister(Portable | Mapped)``. We do not use ``torch.empty(pin_memory=True)``: torch's
caching host allocator rounds every request up to a power of two (3 GiB would pin 4 GiB) and keeps
freed blocks pinned in its cache, so the budget's numbers would be wrong in both directions.
Registration pins exactly the page-rounded size and ``cudaHostUnregister`` gives it back.
If registration fails we raise ``PinningFailed``: there is no silent fallback to pageable memory
(pageable host→device copies run several times slower than pinned ones).

CPU-only hosts have no CUDA runtime to pin with: there (``pin=False``) buffers are plain RAM,
``PinnedBuffer.pinned`` is False and says so, and the budget counts them exactly the same way,
so accounting and refusals behave identically in CI.
"""
from __future__ import annotations

import itertools
import mmap
import weakref
from dataclasses import dataclass

import structlog
import torch

from residency.dataplane.pools.errors import IntegrityError, PinnedBudgetExceeded, PinningFailed

PAGE_BYTES = 4096
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
log = structlog.get_logger("dataplane.pinned")


@dataclass(frozen=True)
class PinnedGrant:
    grant_id: int
    owner: str
    bytes: int


def page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class PinnedBudget:
    """Counts pinned bytes per owner against one limit. Not thread-safe: the mover's one thread uses it."""

    def __init__(self, limit_bytes: int, pin: bool):
        if limit_bytes < 0:
            raise ValueError(f"pinned budget limit must be >= 0, got {limit_bytes}")
        self.limit_bytes = int(limit_bytes)
        self.pin = pin
        self._grants: dict[int, PinnedGrant] = {}
        self._ids = itertools.count(1)
        # told of every grant made or given back: listener(owner, bytes, registered) (the worker's
        # memory books, which tell the control)
        self.listener = None

    # ------------------------------------------------------------ queries
    @property
    def in_use_bytes(self) -> int:
        return sum(g.bytes for g in self._grants.values())

    @property
    def available_bytes(self) -> int:
        return self.limit_bytes - self.in_use_bytes

    def refusal(self, owner: str, nbytes: int) -> PinnedBudgetExceeded | None:
        """The refusal ``register`` would raise for this ask, or None if it can be funded. Pure."""
        avail = self.available_bytes
        if nbytes > avail:
            return PinnedBudgetExceeded(owner, nbytes, avail, self.limit_bytes, self.in_use_bytes)
        return None

    def grants(self) -> list[PinnedGrant]:
        return list(self._grants.values())

    # ------------------------------------------------------------ mutations
    def register(self, owner: str, nbytes: int) -> PinnedGrant:
        """Record ``nbytes`` of pinned memory for ``owner``; raises PinnedBudgetExceeded, changing nothing."""
        if nbytes < 0:
            raise ValueError(f"{owner}: pinned bytes must be >= 0, got {nbytes}")
        refused = self.refusal(owner, nbytes)
        if refused is not None:
            raise refused
        grant = PinnedGrant(next(self._ids), owner, int(nbytes))
        self._grants[grant.grant_id] = grant
        if self.listener is not None:
            self.listener(owner, grant.bytes, True)
        return grant

    def release(self, grant: PinnedGrant) -> int:
        """Forget a grant; returns its bytes. Releasing twice raises IntegrityError."""
        if self._grants.pop(grant.grant_id, None) is None:
            raise IntegrityError(f"pinned grant {grant.grant_id} ({grant.owner}, {grant.bytes} bytes) released twice")
        if self.listener is not None:
            self.listener(grant.owner, grant.bytes, False)
        return grant.bytes

    def alloc(self, owner: str, shape: tuple[int, ...], dtype: torch.dtype) -> "PinnedBuffer":
        """Register, then allocate and pin a buffer of ``shape``/``dtype``. Refusals raise, nothing leaks."""
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        footprint = page_round(max(nbytes, 1))
        grant = self.register(owner, footprint)
        try:
            return PinnedBuffer(self, grant, shape, dtype, nbytes, footprint)
        except BaseException:
            self.release(grant)
            raise

    def holds(self, grant: PinnedGrant) -> bool:
        return self._grants.get(grant.grant_id) == grant

    def check_integrity(self) -> None:
        used = self.in_use_bytes
        if used > self.limit_bytes:
            raise IntegrityError(f"pinned budget over its limit: in use {used} > limit {self.limit_bytes}")
        neg = [g for g in self._grants.values() if g.bytes < 0]
        if neg:
            raise IntegrityError(f"pinned grants with negative bytes: {neg}")


class PinnedBuffer:
    """A budgeted host buffer: ``tensor`` has the asked shape and dtype; ``close()`` unpins and frees."""

    def __init__(self, budget: PinnedBudget, grant: PinnedGrant, shape, dtype, nbytes: int, footprint: int):
        self.budget = budget
        self.grant = grant
        self.owner = grant.owner
        self.nbytes = nbytes
        self.footprint_bytes = footprint
        # Page-aligned anonymous memory of its own (mmap), so the registered range shares no page
        # with another registration (cudaHostRegister refuses overlaps) and the tensor's storage
        # starts exactly where the registration does: torch's is_pinned() looks at the storage
        # base, and a view into a larger pageable allocation would read as pageable.
        self._mm = mmap.mmap(-1, footprint)
        region = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._ptr = region.data_ptr()
        self.pinned = False
        if budget.pin:
            self.how = "cudaHostRegister"
            self._register(footprint)
            self.pinned = True
        else:
            self.how = "pageable (no CUDA on this host: pin_memory is unavailable)"
        self.tensor = region[:nbytes].view(dtype).view(shape)
        self._closed = False
        # NOTE: a buffer dropped without close() must still be unregistered before its mapping
        # goes: the driver keeps a registration after munmap, the kernel hands the same addresses
        # to the next mmap, and that one's cudaHostRegister then fails (cudaErrorHostMemory-
        # AlreadyRegistered, 712). The finalizer holds the mapping until it has unregistered it.
        self._finalizer = weakref.finalize(self, _release_forgotten, budget, grant,
                                           self._ptr if self.pinned else 0, self._mm)
        self._finalizer.atexit = False

    def _register(self, footprint: int) -> None:
        try:
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(
                self._ptr, footprint, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED))
        except Exception as e:  # no CUDA runtime in this build
            raise PinningFailed(f"{self.owner}: cannot page-lock {footprint} bytes: {e}") from e
        if err != 0:
            raise PinningFailed(f"{self.owner}: cudaHostRegister({footprint} bytes) failed with cudaError {err}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if self.pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(self._ptr))
            if err != 0:
                raise PinningFailed(f"{self.owner}: cudaHostUnregister failed with cudaError {err}")
        self.tensor = None      # the mapping goes away with the last view of it
        self.budget.release(self.grant)


def _release_forgotten(budget: PinnedBudget, grant: PinnedGrant, ptr: int, mm: mmap.mmap) -> None:
    """A PinnedBuffer collected without ``close()``: unregister its range (``ptr`` 0: never
    pinned) while ``mm`` still holds the mapping, and give its grant back to the budget."""
    log.warning("pinned_buffer_not_closed", owner=grant.owner, bytes=grant.bytes)
    if ptr:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception as e:      # a finalizer cannot raise to anyone; say it instead
            log.error("pinned_unregister_failed", owner=grant.owner, error=str(e))
    if budget.holds(grant):
        budget.release(grant)
