"""The port the serving scheduler serves: the ``Backend`` protocol and the values that cross it.

The HTTP API (``control.api``) is its one caller: it validates, streams and counts, and decides
nothing about memory. Everything else (render and tokenize the prompt, admit against the budget,
reuse or restore a session's prefix, run the model, free blocks) happens behind
``Backend.submit``. ``control.scheduler.service.ServingService`` implements it; the API's unit
tests use a fake at the edge. It is declared here, beside its implementation, so the scheduler
never imports the API.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Protocol, runtime_checkable

from residency.events.commands import ChatTurn, SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    sampling: SamplingParams
    messages: list[ChatTurn] | None = None       # chat
    prompt: str | None = None                    # completion, text
    prompt_token_ids: list[int] | None = None    # completion, token ids
    session: str | None = None
    max_tokens_given: bool = False               # False: max_tokens is "the rest of the context"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0        # prompt positions whose KV was reused (resident or restored)
    restored_tokens: int = 0      # of those, brought back from host or disk for this request
    computed_tokens: int = 0      # prompt positions prefilled for this request
    shared_tokens: int = 0        # of the cached, another session's pages (resident or restored first)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Chunk:
    """A piece of one generation. The last one has ``finish_reason`` and ``usage``."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None      # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None
    error: str | None = None              # set with finish_reason "error"
    logprobs: list = field(default_factory=list)   # events.commands.TokenLogprobs, asked for
    # an error that is the server's state, not the request's (its worker was lost or wedged): the
    # HTTP status and code to answer with, and when a retry may fare better (None: not retryable)
    status: int | None = None
    code: str | None = None
    retry_after_s: int | None = None


@runtime_checkable
class GenerationStream(Protocol):
    request_id: str
    model: str

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    def cancel(self, reason: str) -> None:
        """Stop generating (idempotent, thread-safe, never blocks). The blocks are freed with
        ``reason`` recorded in the ledger; the stream then ends with finish_reason "cancelled"."""


@dataclass(frozen=True)
class ModelCard:
    id: str
    max_context: int
    created: int
    owned_by: str = "residency"
    # where its weights are (issue #28): resident (a worker's arena serves it), asleep (a worker's
    # arena slept with it), host (a pinned image), file (only its file); None: not said
    residency: str | None = None
    arena_gen: int | None = None      # the generation of the arena holding it (None: no arena holds it)


@dataclass(frozen=True)
class SessionInfo:
    session: str
    tier: str | None              # "device" | "host" | "disk" | None (holds nothing)
    num_blocks: int
    num_tokens: int
    bytes: int
    busy: bool
    last_used_ns: int
    move_id: str | None = None    # the move the admin call caused, if any
    blocks_by_tier: dict[str, int] = field(default_factory=dict)   # pages with a copy on each tier
    note: str | None = None       # what the admin call did when it moved nothing, or what stayed and why


@dataclass
class BackendStats:
    """What /metrics exports at scrape time, read from the control process's folded state."""

    tier_used_bytes: dict[tuple[str, str], int] = field(default_factory=dict)       # (worker, tier)
    tier_capacity_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    moves: dict[tuple[str, str], int] = field(default_factory=dict)                 # (kind, outcome)
    stranded_bytes: int = 0
    ledger_append_lag_s: float | None = None      # None = not measured
    ledger_last_seq: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    sessions_by_tier: dict[str, int] = field(default_factory=dict)
    restore_decisions: dict[str, int] = field(default_factory=dict)                 # restore|recompute|shared
    routed: dict[str, int] = field(default_factory=dict)                            # session|prefix|load
    draining: bool = False                        # stopping: new requests are refused
    disk_bytes_kept: int = 0                      # disk copies kept across worker incarnations (ledger)
    disk_bytes_dropped: int = 0                   # files a new incarnation deleted as not the ledger's
    steps_by_path: dict[str, int] = field(default_factory=dict)     # serving steps by decode path: graph|eager
    restores_by_path: dict[str, int] = field(default_factory=dict)  # turns run after a restore: pipelined|plain
    restore_wait_s: float = 0.0                   # what prefills waited for landing pages, as the workers measured
    num_restore_waits: int = 0                    # steps that waited for landing pages (the count of that sum)
    # an offloaded MoE model's experts (ExpertsMoved as recorded): moves by kind (fetch|prefetch|evict),
    # bytes copied host -> device, and the routed experts' bytes served by where they were (device|fetched)
    expert_moves: dict[str, int] = field(default_factory=dict)
    expert_fetched_bytes: int = 0
    expert_served_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: dict[str, object] = field(default_factory=dict)


class BackendError(Exception):
    """A request the backend declines or cannot serve; the API renders it OpenAI-shaped."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s    # sent as Retry-After: the same request may succeed then


class UnknownSession(BackendError):
    def __init__(self, session: str):
        super().__init__(404, f"no session named {session!r}", code="session_not_found", param="session_id")


class Backend(Protocol):
    def models(self) -> list[ModelCard]:
        """The models served now (empty while the worker is still loading)."""

    async def submit(self, req: GenerateRequest) -> GenerationStream:
        """Admit and start one generation. Raises BackendError (context too long, refused,
        session busy, unknown model) before anything is streamed; never returns a stream
        that failed admission."""

    async def park(self, session: str, tier: str = "host") -> SessionInfo:
        """Move an idle session's blocks off the device to ``tier`` (host or disk). Raises
        UnknownSession; BackendError(409) when the session is busy."""

    async def restore(self, session: str) -> SessionInfo:
        """Bring a parked session's blocks back to the device (checksum-verified)."""

    async def sessions(self, limit: int) -> tuple[list[SessionInfo], int]:
        """The sessions known (most recently used first, at most ``limit``) and how many in all."""

    async def delete(self, session: str) -> tuple[SessionInfo, int]:
        """Free every copy of an idle session's pages (recorded) and forget it: (what it held,
        bytes freed). Raises UnknownSession; BackendError(409) when the session is busy."""

    async def session(self, session: str) -> SessionInfo:
        """Where a session's blocks are. Raises UnknownSession."""

    async def memory(self, probe_timeout_ms: int) -> bytes:
        """The memory view as JSON (control/memory.py), each worker probed for at most
        ``probe_timeout_ms``. Raises BackendError(503) when the control loop does not answer."""

    def stats(self) -> BackendStats: ...

    def health(self) -> Health: ...

    async def ask_control(self, ask):
        """An operator's ask of the control process (e.g. ``AskResize``, the admin resize route);
        its ``AskAnswered`` once what it recorded is committed."""
