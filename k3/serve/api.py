"""OpenAI-compatible HTTP API on FastAPI: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/health``.

Requests are parsed and validated here, in the event loop, before anything reaches the engine: a malformed body,
an unknown model, a missing or out-of-range field or a prompt longer than the model's context gets HTTP 400 with
OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``; a full waiting queue gets 429. Valid
requests go to the engine (``k3 serve``: an :class:`k3.serve.process.EngineProcess`, the engine in its own process;
an in-process :class:`k3.serve.engine.Engine` also fits), whose events come back on another thread and through
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``. ``stream: true`` answers with server-sent events
in OpenAI's chunk format, ending with ``data: [DONE]``; a client that disconnects has its request cancelled (the
streaming response is cancelled by Starlette on disconnect; a non-streaming one polls for it), which frees its slot.

Supported parameters: ``model``, ``prompt`` (a string, token ids, or a list of one of those) / ``messages``,
``max_tokens`` (chat: also ``max_completion_tokens``; default 16 for completions, the rest of the context for chat),
``temperature`` [0, 2], ``top_p``, ``top_k`` (-1 or 0 = off), ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``echo`` (completions), ``n`` = 1, and vLLM's ``stop_token_ids`` /
``ignore_eos``. Unsupported features asked for with a non-default value (``logprobs``, penalties, ``logit_bias``,
``tools``, ``n`` > 1, …) are a 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.infer.generate import prompt_ids
from k3.infer.sampling import SamplingParams
from k3.serve.chat import ChatFormat
from k3.serve.engine import Engine, Event, QueueFull
from k3.serve.process import EngineProcess

__all__ = ["create_app", "APIError"]

_MAX_BODY = 64 << 20
_MAX_STOPS = 16
_DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=_error_body(self.message, self.type, self.param,
                                                                         self.code))


def _error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# --- request parsing -------------------------------------------------------------------------------------------------
async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > _MAX_BODY:
        raise _bad(f"the request body is larger than {_MAX_BODY} bytes", code="body_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", code="invalid_json")
    return body


def _int(body: dict, name: str, lo: int | None = None, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise _bad(f"{name} must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}", name)
    return v


def _num(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise _bad(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def _unsupported(body: dict, name: str, *defaults: Any) -> None:
    """``name`` may be absent or hold a default value; anything else is a feature this server does not have."""
    if name in body and body[name] not in (None, *defaults):
        raise _bad(f"{name} is not supported by this server (got {body[name]!r})", name, "unsupported_parameter")


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or len(v) > _MAX_STOPS or not all(isinstance(s, str) and s for s in v):
        raise _bad(f"stop must be a non-empty string or a list of at most {_MAX_STOPS} of them", "stop")
    return tuple(v)


class _Parsed:
    """A validated request: prompt ids, sampling parameters and the response options."""

    def __init__(self, ids: list[int], params: SamplingParams, stream: bool, include_usage: bool,
                 echo_text: str | None = None) -> None:
        self.ids, self.params, self.stream, self.include_usage, self.echo_text = ids, params, stream, include_usage, \
            echo_text


def _common(body: dict, ids: list[int], capacity: int, default_max: int | None, max_name: str,
            prompt_param: str, extra_stops: tuple[str, ...] = ()) -> tuple[SamplingParams, bool, bool]:
    for name, ok in (("n", (1,)), ("best_of", (1,)), ("logprobs", (False, 0)), ("top_logprobs", (0,)),
                     ("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                     ("repetition_penalty", (1, 1.0)), ("logit_bias", ({},)), ("suffix", ("",)), ("tools", ([],)),
                     ("tool_choice", ("none", "auto")), ("response_format", ({"type": "text"},))):
        _unsupported(body, name, *ok)
    room = capacity - len(ids)
    if room < 1:
        raise _bad(f"the prompt has {len(ids)} tokens; this model's context is {capacity} tokens", prompt_param,
                   "context_length_exceeded")
    max_tokens = _int(body, max_name, 1, None)
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else room
        max_tokens = min(max_tokens, room)
    if len(ids) + max_tokens > capacity:
        raise _bad(f"the prompt ({len(ids)} tokens) plus {max_name} ({max_tokens}) exceeds this model's context of "
                   f"{capacity} tokens", prompt_param, "context_length_exceeded")
    top_k = _int(body, "top_k", -1, 0)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in stop_ids):
        raise _bad("stop_token_ids must be a list of non-negative integers", "stop_token_ids")
    for flag in ("stream", "ignore_eos", "echo"):
        if not isinstance(body.get(flag, False), bool):
            raise _bad(f"{flag} must be a boolean", flag)
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise _bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    seed = _int(body, "seed", None, None)
    params = SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
                            top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True), top_k=max(top_k, 0),
                            seed=seed, stop=_stops(body) + extra_stops, stop_token_ids=tuple(stop_ids),
                            ignore_eos=bool(body.get("ignore_eos", False)))
    return params, bool(body.get("stream", False)), bool((opts or {}).get("include_usage", False))


def _prompt(body: dict, tokenizer: Any, vocab: int) -> tuple[list[int], str]:
    if "prompt" not in body:
        raise _bad("prompt is required", "prompt", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise _bad("only one prompt per request is supported", "prompt")
        p = p[0]
    if isinstance(p, str):
        try:
            return prompt_ids(tokenizer, p), p
        except ValueError as e:
            raise _bad(str(e), "prompt") from None
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        if min(p) < 0 or max(p) >= vocab:
            raise _bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(p), tokenizer.decode(p)
    raise _bad("prompt must be a string or a non-empty list of token ids", "prompt")


# --- responses --------------------------------------------------------------------------------------------------------
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(ev: Event) -> dict[str, int]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}


def _finish_error(ev: Event) -> APIError | None:
    if ev.finish_reason == "error":
        return APIError(500, f"generation failed: {ev.error}", type_="server_error", code="engine_error")
    if ev.finish_reason == "cancelled":
        return APIError(503, "the server is shutting down", type_="server_error", code="shutting_down")
    return None


class _Kind:
    """Shapes of the completion vs chat responses."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self.head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [choice]}

    def text_sse(self) -> Callable[[str], str]:
        """``text → _sse(self.chunk(text))``, byte for byte, from a template cut once per request: a stream's
        per-token work is one ``json.dumps`` of the text, not of the whole chunk."""
        marker = "\x00k3-text\x00"
        head, _, tail = _sse(self.chunk(marker)).rpartition(json.dumps(marker, ensure_ascii=False))  # text is last
        return lambda text: head + json.dumps(text, ensure_ascii=False) + tail

    def usage_chunk(self, ev: Event) -> dict[str, Any]:
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": _usage(ev)}

    def full(self, text: str, ev: Event) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
            return {**self.head("chat.completion"), "choices": [choice], "usage": _usage(ev)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
        return {**self.head("text_completion"), "choices": [choice], "usage": _usage(ev)}


class _Bridge:
    """Engine events → event loop: events are queued here and delivered by one loop callback per burst (a decode
    step of 64 streams wakes the loop once, not 64 times)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Event]] = []

    def put(self, q: asyncio.Queue, ev: Event) -> None:
        with self.lock:
            self.pending.append((q, ev))
            if len(self.pending) > 1:
                return  # a delivery is already scheduled
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens any more
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for q, ev in items:
            q.put_nowait(ev)


def _coalesce(ev: Event, events: asyncio.Queue) -> Event:
    """``ev`` merged with every event already queued behind it (one SSE chunk for what a slow reader missed)."""
    while ev.finish_reason is None and not events.empty():
        nxt = events.get_nowait()
        ev = Event(ev.text + nxt.text, ev.token_ids + nxt.token_ids, nxt.finish_reason, nxt.prompt_tokens,
                   nxt.completion_tokens, nxt.error)
    return ev


# --- the app ----------------------------------------------------------------------------------------------------------
def create_app(engine: Engine | EngineProcess, model_name: str, chat: ChatFormat) -> FastAPI:
    """The FastAPI app serving ``engine`` under the name ``model_name``. The engine is started here if it is not
    running, and stopped when the app shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="k3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code,
                            content=_error_body(str(exc.detail), "invalid_request_error", None, None))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        body = {"status": "ok" if ok else "unavailable", **engine.load()}
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                             "owned_by": "k3", "max_model_len": engine.capacity}]}

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is None:
            raise _bad("model is required", "model", "missing_required_parameter")
        if m != model_name:
            raise _bad(f"the model {m!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _json_body(request)
        check_model(body)
        ids, text = _prompt(body, tokenizer, engine.vocab_size)
        params, stream, usage = _common(body, ids, engine.capacity, 16, "max_tokens", "prompt")
        echo = text if body.get("echo") else None
        return await _serve(request, _Parsed(ids, params, stream, usage, echo), _Kind(False, model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _json_body(request)
        check_model(body)
        if "messages" not in body:
            raise _bad("messages is required", "messages", "missing_required_parameter")
        try:
            ids = chat.render(body["messages"])
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        params, stream, usage = _common(body, ids, engine.capacity, None, name, "messages", chat.stops)
        return await _serve(request, _Parsed(ids, params, stream, usage), _Kind(True, model_name))

    bridge: list[_Bridge] = []

    async def _serve(request: Request, parsed: _Parsed, kind: _Kind) -> Any:
        if not bridge:
            bridge.append(_Bridge(asyncio.get_running_loop()))
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            req = engine.submit(parsed.ids, parsed.params, lambda ev: bridge[0].put(events, ev))
        except QueueFull as e:
            raise APIError(429, f"the server is busy ({e}); retry later", type_="rate_limit_error",
                           code="queue_full") from None
        except ValueError as e:
            raise _bad(str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type_="server_error", code="engine_unavailable") from None
        if parsed.stream:
            return StreamingResponse(_stream(req, events, parsed, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, req, events, parsed, kind)

    async def _collect(request: Request, req: Any, events: asyncio.Queue, parsed: _Parsed, kind: _Kind) -> Any:
        pieces = [parsed.echo_text] if parsed.echo_text else []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                pieces.append(ev.text)
                if ev.finish_reason is not None:
                    err = _finish_error(ev)
                    if err is not None:
                        raise err
                    return kind.full("".join(pieces), ev)
        finally:
            engine.cancel(req)  # a no-op once finished; frees the slot of a client that went away

    async def _stream(req: Any, events: asyncio.Queue, parsed: _Parsed, kind: _Kind) -> AsyncIterator[str]:
        try:
            if kind.chat:
                yield _sse(kind.chunk("", role=True))
            if parsed.echo_text:
                yield _sse(kind.chunk(parsed.echo_text))
            text_sse = kind.text_sse()
            while True:
                ev = _coalesce(await events.get(), events)
                if ev.text:
                    yield text_sse(ev.text)
                if ev.finish_reason is not None:
                    err = _finish_error(ev)
                    if err is not None:
                        yield _sse(_error_body(err.message, err.type, None, err.code))
                    else:
                        yield _sse(kind.chunk(None if kind.chat else "", finish=ev.finish_reason))
                        if parsed.include_usage:
                            yield _sse(kind.usage_chunk(ev))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            engine.cancel(req)  # the client disconnected (this generator was cancelled) or the stream ended

    return app
