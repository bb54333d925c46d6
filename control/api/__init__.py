"""The OpenAI-compatible HTTP API (FastAPI). Decides nothing about memory: see ``control.scheduler.port``."""
from residency.control.api.app import ApiConfig, create_app
from residency.control.scheduler.port import (
    Backend,
    BackendError,
    BackendStats,
    Chunk,
    GenerateRequest,
    GenerationStream,
    Health,
    ModelCard,
    SessionInfo,
    UnknownSession,
    Usage,
)

__all__ = [
    "ApiConfig", "create_app", "Backend", "BackendError", "BackendStats", "Chunk", "GenerateRequest",
    "GenerationStream", "Health", "ModelCard", "SessionInfo", "UnknownSession", "Usage",
]
