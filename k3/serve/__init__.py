"""Serving: the continuous-batching engine (``engine.py``), chat prompts (``chat.py``) and the OpenAI-compatible HTTP
server (``api.py``, FastAPI + uvicorn; ``k3 serve``)."""

from k3.serve.engine import Engine, Event, QueueFull, Request

__all__ = ["Engine", "Event", "QueueFull", "Request"]
