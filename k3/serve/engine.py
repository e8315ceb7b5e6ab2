"""The serving engine: continuous batching over a ``ModelRunner``'s slot pool, in its own thread.

Each iteration of the engine thread:

1. drops cancelled requests and admits waiting ones into free slots (FIFO; the slot is reset on the device);
2. launches one decode step for every request that is generating (``ModelRunner.decode``: one CUDA-graph replay);
3. spends up to ``prefill_budget`` prompt tokens on requests still prefilling, in chunks, so a long prompt shares the
   GPU with the running decodes instead of stalling them; a request whose prompt is complete gets its first token
   sampled on the device and joins the decodes of the next iteration;
4. only then reads back the tokens of the work launched in earlier iterations (pinned copies + events), so the host's
   detokenising, stop checks and streaming overlap the GPU's next step. A request that stops on a token or string
   has already been given one more step; that token is dropped. ``max_tokens`` is known in advance: no step is
   launched past it.

Requests stop on a stop token id (the tokenizer's unless ``ignore_eos``, plus their own), a stop string (text is
detokenised incrementally with ``StreamDecoder``; text that might begin a stop string is held back until it cannot),
``max_tokens``, or cancellation. Their output goes to a per-request ``sink`` (called on the engine thread; the
default puts events in ``Request.events``, a ``queue.Queue``). Inputs are validated in ``submit`` (the caller's
thread), so a bad request never reaches the engine; when every slot is busy requests wait in a bounded queue and
``submit`` raises :class:`QueueFull` beyond it.
"""

from __future__ import annotations

import collections
import itertools
import queue
import secrets
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from k3.infer.generate import StreamDecoder
from k3.infer.runner import ModelRunner, Pending
from k3.infer.sampling import SEED_LIMIT, SamplingParams

__all__ = ["Engine", "Request", "Event", "QueueFull", "TextStream", "check_request", "collect"]


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


def check_request(prompt: Sequence[int], params: SamplingParams, vocab_size: int, capacity: int) -> list[int]:
    """The prompt as a list of ints, or ``ValueError`` naming what is wrong with the request."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("the prompt must hold at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    if len(ids) + params.max_tokens > capacity:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {capacity} tokens")
    return ids


@dataclass
class Event:
    """Output of a request: new text and token ids; ``finish_reason`` ("stop", "length", "cancelled", "error") on
    the last event, with the token counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def collect(events: "queue.Queue[Event]") -> tuple[str, list[int], Event]:
    """A request's events read to its last: ``(text, token ids, last event)``."""
    text, ids = [], []
    while True:
        ev = events.get()
        text.append(ev.text)
        ids += ev.token_ids
        if ev.finish_reason is not None:
            return "".join(text), ids, ev


class TextStream:
    """Incremental detokenisation with stop strings: ``feed(token) → (text, stopped)``. Text that could still
    become the start of a stop string is held back; a stop string and anything after it is never emitted."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.decoder = StreamDecoder(tokenizer)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, token: int) -> tuple[str, bool]:
        self.pending += self.decoder.feed(token)
        return self._emit(final=False)

    def finish(self) -> tuple[str, bool]:
        """Everything still held (at the end of the generation)."""
        self.pending += self.decoder.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, bool]:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0 if final else min(self.hold, len(self.pending))
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


@dataclass(eq=False)
class Request:
    """One generation request (create through ``Engine.submit``)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    sink: Callable[[Event], None]
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    slot: int | None = None
    fed: int = 0  # prompt tokens prefilled
    launched: int = 0  # tokens whose generation has been launched
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None
    done: bool = False
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.fed == len(self.prompt) and not self.done


class Engine:
    """Continuous batching over ``model`` (see the module docstring).

    ``max_batch``: concurrent sequences (slots). ``max_queue``: requests that may wait for a slot (beyond:
    ``QueueFull``). ``prefill_budget``: prompt tokens per iteration (default: one prefill chunk). ``capacity``,
    ``prefill_chunk``, ``cuda_graphs``: as :class:`ModelRunner`. ``after_iteration``: called on the engine thread
    after each pass of its loop, once that pass's events are out (``k3.serve.process`` sends them in one message)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch: int = 8, max_queue: int = 64,
                 prefill_budget: int | None = None, capacity: int | None = None, prefill_chunk: int | None = None,
                 cuda_graphs: bool | str = "auto", after_iteration: Callable[[], None] | None = None) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative integer, got {max_queue!r}")
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, max_batch=max_batch, capacity=capacity, prefill_chunk=prefill_chunk,
                                  cuda_graphs=cuda_graphs, vocab_limit=getattr(tokenizer, "vocab_size", None))
        if prefill_budget is not None and (isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int)
                                           or prefill_budget < 1):
            raise ValueError(f"prefill_budget must be a positive integer (tokens), got {prefill_budget!r}")
        self.prefill_budget = prefill_budget or self.runner.prefill_chunk
        self.max_queue = max_queue
        self.vocab_size = model.config.vocab_size
        self.tokenizer_stops = frozenset(int(i) for i in (getattr(tokenizer, "stop_ids", ()) or ()))
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: dict[int, Request] = {}  # slot → request
        self._inflight: collections.deque[tuple[Pending, list[Request]]] = collections.deque()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: str | None = None  # the last exception the loop survived
        self.stats = collections.Counter()
        self._after_iteration = after_iteration or (lambda: None)

    # --- public API (any thread) ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.runner.capacity

    @property
    def max_batch(self) -> int:
        return self.runner.max_batch

    def start(self) -> "Engine":
        """Start the engine thread (on CUDA: captures the decode graphs and warms the prefill kernels first)."""
        if self._thread is None:
            self.runner.capture_all()
            if self.runner.device.type == "cuda":  # nothing compiles on the first CPU prefill
                self.runner.warmup()
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread; unfinished requests end with finish_reason "cancelled"."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               sink: Callable[[Event], None] | None = None) -> Request:
        """Queue a request (validated here: ``ValueError`` for bad input, ``QueueFull`` when the queue is full)."""
        ids = check_request(prompt, params, self.vocab_size, self.capacity)
        seed = params.seed % SEED_LIMIT if params.seed is not None else secrets.randbits(63)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer_stops)
        req = Request(id=f"{next(self._ids)}", prompt=ids, params=params, seed=seed, stop_ids=stops,
                      sink=lambda e: None)
        req.sink = sink if sink is not None else req.events.put
        req.text = TextStream(self.tokenizer, params.stop)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is stopping")
            if len(self._active) + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for one of {self.max_batch} slots")
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        """Stop ``req`` (its slot is freed at the engine's next iteration); no-op when it has finished."""
        with self._cv:
            req.cancelled = True
            self._cv.notify_all()

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> tuple[str, list[int], Event]:
        """Submit and wait: ``(text, token ids, last event)``."""
        return collect(self.submit(prompt, params).events)

    def load(self) -> dict[str, int]:
        with self._cv:
            return {"running": len(self._active), "waiting": len(self._waiting), "slots": self.max_batch}

    # --- the engine thread ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.runner.device.type == "cuda":  # this thread's launches go to the model's GPU
            torch.cuda.set_device(self.runner.device)
        while True:
            with self._cv:
                while not self._stopping and not (self._waiting or self._active or self._inflight):
                    self._cv.wait()
                if self._stopping:
                    break
                admitted = self._admit()
            try:
                self._iteration(admitted)
            except Exception as e:  # noqa: BLE001 — fail the requests in flight, keep serving
                self.error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                self._fail_all(self.error)
            self._after_iteration()
        self._fail_all(None)
        self._after_iteration()

    def _admit(self) -> list[Request]:
        """Under the lock: drop cancelled requests, give free slots to waiting ones (FIFO)."""
        for slot, req in list(self._active.items()):
            if req.cancelled:
                self._finish(req, "cancelled")
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            self._finish(req, "cancelled")
        free = [s for s in range(self.max_batch) if s not in self._active]
        admitted = []
        while free and self._waiting:
            req = self._waiting.popleft()
            req.slot = free.pop(0)
            self._active[req.slot] = req
            admitted.append(req)
        return admitted

    def _iteration(self, admitted: list[Request]) -> None:
        for req in admitted:
            self.runner.admit(req.slot, req.params, req.seed)
        launched = 0
        decoding = [r for r in self._active.values() if r.decoding and r.launched < r.params.max_tokens]
        if decoding:
            self._inflight.append((self.runner.decode([r.slot for r in decoding]), decoding))
            for r in decoding:
                r.launched += 1
            self.stats["decode_steps"] += 1
            launched += 1
        launched += self._prefill()
        self._drain(keep=launched)

    def _prefill(self) -> int:
        """Spend the prefill budget on requests still prefilling (oldest first); returns the launches made. Pieces
        of one length run together, as the rows of one forward (requests that arrive together with prompts of one
        length are prefilled in one batch instead of one by one)."""
        budget, plan = self.prefill_budget, []
        for req in sorted((r for r in self._active.values() if r.fed < len(r.prompt)), key=lambda r: r.submitted_at):
            if budget <= 0:
                break
            take = min(budget, len(req.prompt) - req.fed)
            plan.append((req, take))
            budget -= take
        groups: dict[tuple[int, bool], list[Request]] = {}
        for req, take in plan:
            groups.setdefault((take, req.fed + take == len(req.prompt)), []).append(req)
        n = 0
        for (take, last), reqs in groups.items():
            pending = self.runner.prefill_batch([r.slot for r in reqs],
                                                [r.prompt[r.fed:r.fed + take] for r in reqs], last=last)
            self.stats["prefill_calls"] += 1
            for r in reqs:
                r.fed += take
                self.stats["prefill_tokens"] += take
                if last:
                    r.launched = 1
            if last:
                self._inflight.append((pending, reqs))
                n += 1
        return n

    def _drain(self, keep: int) -> None:
        """Process read-backs, all but the newest ``keep`` (launched this iteration, still running on the GPU)."""
        while len(self._inflight) > keep:
            pending, reqs = self._inflight.popleft()
            for req, tok in zip(reqs, pending.tokens()):
                if not req.done:
                    self._on_token(req, tok)

    def _on_token(self, req: Request, tok: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.generated.append(tok)
        self.stats["tokens"] += 1
        if tok in req.stop_ids:
            text, _ = req.text.finish()
            req.sink(Event(text, [tok]))
            self._finish(req, "stop")
            return
        text, stopped = req.text.feed(tok)
        if stopped:
            req.sink(Event(text, [tok]))
            self._finish(req, "stop")
        elif len(req.generated) >= req.params.max_tokens:
            tail, _ = req.text.finish()
            req.sink(Event(text + tail, [tok]))
            self._finish(req, "length")
        else:
            req.sink(Event(text, [tok]))

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Free the slot and send the last event."""
        with self._cv:
            if req.done:
                return
            req.done = True
            if req.slot is not None and self._active.get(req.slot) is req:
                del self._active[req.slot]
        req.sink(Event("", [], finish_reason=reason, prompt_tokens=len(req.prompt),
                       completion_tokens=len(req.generated), error=error))

    def _fail_all(self, error: str | None) -> None:
        """End every request (an error in the loop, or shutdown)."""
        with self._cv:
            self._inflight.clear()
            for req in list(self._active.values()) + list(self._waiting):
                self._finish(req, "error" if error else "cancelled", error)
            self._waiting.clear()
