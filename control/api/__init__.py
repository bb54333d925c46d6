"""The OpenAI-compatible HTTP API (FastAPI). Decides nothing about memory: it calls the port the
serving scheduler declares (``control.scheduler.port``)."""
from residency.control.api.app import ApiConfig, create_app

__all__ = ["ApiConfig", "create_app"]
