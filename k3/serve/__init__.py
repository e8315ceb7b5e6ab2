"""Serving: the continuous-batching engine (``engine.py``) and the same engine in its own process (``process.py``),
chat prompts (``chat.py``) and the OpenAI-compatible HTTP server (``api.py``, FastAPI + uvicorn; ``k3 serve``)."""

from k3.serve.engine import Engine, Event, QueueFull, Request
from k3.serve.process import EngineProcess

__all__ = ["Engine", "EngineProcess", "Event", "QueueFull", "Request"]
