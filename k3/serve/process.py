"""The engine in its own process: :class:`EngineProcess` runs an :class:`~k3.serve.engine.Engine` in a child process
and stands in for it where the HTTP app expects an engine (``submit``, ``cancel``, ``load``, ``alive``, …).

Why a process: the HTTP side (parsing, SSE framing, socket writes) costs tens of microseconds of Python per streamed
token, and so does the engine's loop (launches, read-backs, detokenising, stop checks). In one process they take
turns on one interpreter lock, and at 64 streams the two together need more host time than a decode step takes on
the GPU: the server then runs at the host's speed, not the GPU's. vLLM splits its API server from its engine core
for the same reason.

The child loads the model itself (``load(*load_args) -> (model, tokenizer)``, a module-level function, so the spawn
start method can name it), builds the engine and reports its sizes. Requests are validated in the caller's process
(``check_request``, the queue bound), so bad input never crosses. Messages are pickled over one pipe:

- parent → child: ``("submit", rid, ids, params)``, ``("cancel", rid)``, ``("stop",)``;
- child → parent: ``("ready", info)`` or ``("error", kind, message)`` once, then ``("events", [(rid, event
  fields…)…], load)`` once per pass of the engine's loop that produced events (a decode step of 64 streams is one
  message), and ``("stopped",)``.

A reader thread in the parent hands each event to its request's ``sink``. If the child dies, every open request ends
with an "error" event and ``alive`` turns false. The child exits when the parent closes the pipe (or dies).
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from k3.infer.sampling import SamplingParams
from k3.serve.engine import Engine, Event, QueueFull, check_request, collect

__all__ = ["EngineProcess", "Ticket"]

_START_TIMEOUT_S = 1800.0  # a large checkpoint from a slow disk, plus graph capture and the prefill warm-up


@dataclass(eq=False)
class Ticket:
    """A request sent to the engine process (returned by :meth:`EngineProcess.submit`)."""

    id: int
    sink: Callable[[Event], None]
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    done: bool = False


class EngineProcess:
    """An :class:`~k3.serve.engine.Engine` over the model that ``load(*load_args)`` builds, in a child process.

    ``tokenizer``: the same tokenizer, loaded in this process (the app renders chat prompts and counts tokens with
    it; the child detokenises with its own). ``engine_kwargs``: the engine's (``max_batch``, ``max_queue``,
    ``capacity``, ``prefill_chunk``, …).
    """

    def __init__(self, load: Callable[..., tuple[Any, Any]], load_args: Sequence[Any], tokenizer: Any,
                 **engine_kwargs: Any) -> None:
        max_queue = engine_kwargs.get("max_queue", 64)
        max_batch = engine_kwargs.get("max_batch", 8)
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.tokenizer = tokenizer
        self._load, self._load_args, self._kwargs = load, tuple(load_args), engine_kwargs
        self.max_batch, self.max_queue = max_batch, max_queue
        self.capacity = self.vocab_size = 0
        self.device = "?"
        self._proc: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._open: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._load_state = {"running": 0, "waiting": 0, "slots": max_batch}
        self._reader: threading.Thread | None = None
        self._stopped = threading.Event()
        self._dead = False

    # --- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "EngineProcess":
        """Start the child and wait until its engine runs (``ValueError``/``RuntimeError`` with the child's reason
        if it could not load the model or start the engine)."""
        if self._proc is not None:
            return self
        self._dead = False
        self._stopped.clear()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot live on in a forked child
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child_main, name="k3-engine",
                                 args=(child, self._load, self._load_args, self._kwargs))
        self._proc.start()
        child.close()
        self._conn = parent
        msg = self._recv_start()
        if msg[0] == "error":
            self._proc.join(timeout=30)
            self._proc = None
            self._conn.close()
            raise (ValueError if msg[1] == "value" else RuntimeError)(msg[2])
        info = msg[1]
        self.capacity, self.vocab_size, self.device = info["capacity"], info["vocab_size"], info["device"]
        self._reader = threading.Thread(target=self._read, name="k3-engine-reader", daemon=True)
        self._reader.start()
        return self

    def _recv_start(self) -> tuple:
        if not self._conn.poll(_START_TIMEOUT_S):
            self._proc.kill()
            return ("error", "runtime", f"the engine process did not start within {_START_TIMEOUT_S:.0f} s")
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(timeout=30)
            return ("error", "runtime", f"the engine process exited while starting (exit code {self._proc.exitcode})")

    def stop(self) -> None:
        """Stop the engine; unfinished requests end with finish_reason "cancelled"."""
        if self._proc is None:
            return
        if not self._dead:
            self._send(("stop",))
            self._stopped.wait(timeout=60)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self._fail_open("the engine process stopped")
        self._proc = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._dead and self._proc.is_alive()

    def load(self) -> dict[str, int]:
        with self._lock:
            return dict(self._load_state)

    # --- requests ----------------------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams,
               sink: Callable[[Event], None] | None = None) -> Ticket:
        """Send a request (validated here: ``ValueError`` for bad input, ``QueueFull`` when as many requests are
        open as there are slots and queue places; ``RuntimeError`` when the engine is not running)."""
        ids = check_request(prompt, params, self.vocab_size, self.capacity)
        with self._lock:
            if not self.alive:
                raise RuntimeError("the engine is not running")
            if len(self._open) >= self.max_batch + self.max_queue:
                raise QueueFull(f"{len(self._open) - self.max_batch} requests are waiting for one of "
                                f"{self.max_batch} slots")
            ticket = Ticket(next(self._ids), sink=lambda e: None)
            ticket.sink = sink if sink is not None else ticket.events.put
            self._open[ticket.id] = ticket
        self._send(("submit", ticket.id, ids, params))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Stop the request (its slot is freed at the engine's next iteration); no-op when it has finished."""
        if not ticket.done and self.alive:
            self._send(("cancel", ticket.id))

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> tuple[str, list[int], Event]:
        """Submit and wait: ``(text, token ids, last event)``."""
        return collect(self.submit(prompt, params).events)

    # --- plumbing ----------------------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):  # the child is gone: the reader fails the open requests
                pass

    def _read(self) -> None:
        """The reader thread: events to their sinks, until the child stops or dies."""
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                if msg[0] == "events":
                    batch = []
                    with self._lock:  # once per message (a decode step of every stream), not per event
                        for rid, *fields in msg[1]:
                            ev = Event(*fields)
                            ticket = self._open.get(rid)
                            if ticket is None:
                                continue
                            if ev.finish_reason is not None:
                                ticket.done = True
                                del self._open[rid]
                            batch.append((ticket, ev))
                    for ticket, ev in batch:
                        self._deliver(ticket, ev)
                    with self._lock:  # after the events: an idle load is never seen before the last event
                        self._load_state = msg[2]
                elif msg[0] == "stopped":
                    break
        except (EOFError, OSError):
            pass
        finally:
            self._dead = True
            self._stopped.set()
            self._fail_open("the engine process exited")

    def _fail_open(self, why: str) -> None:
        with self._lock:
            tickets, self._open = list(self._open.values()), {}
            self._load_state = {"running": 0, "waiting": 0, "slots": self.max_batch}
        for t in tickets:
            t.done = True
            self._deliver(t, Event("", [], finish_reason="error", error=why))

    @staticmethod
    def _deliver(ticket: Ticket, ev: Event) -> None:
        """One event to its sink; a sink that raises loses its event, not every other request's."""
        try:
            ticket.sink(ev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def _child_main(conn: Any, load: Callable[..., tuple[Any, Any]], load_args: tuple, engine_kwargs: dict) -> None:
    """The engine process: load, start the engine, then serve the pipe until "stop" or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides

    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    outbox: list[tuple] = []  # filled and flushed on the engine thread only

    def flush() -> None:
        nonlocal outbox
        if outbox:
            items, outbox = outbox, []
            try:
                send(("events", items, engine.load()))
            except OSError:  # the parent is gone: the main thread sees the pipe close and stops the engine
                pass

    try:
        model, tokenizer = load(*load_args)
        engine = Engine(model, tokenizer, after_iteration=flush, **engine_kwargs)
        engine.start()
    except Exception as e:  # noqa: BLE001 — reported to the parent, which raises it
        send(("error", "value" if isinstance(e, ValueError) else "runtime", f"{e}" if isinstance(e, ValueError)
              else f"{type(e).__name__}: {e}"))
        conn.close()
        return
    send(("ready", {"capacity": engine.capacity, "vocab_size": engine.vocab_size,
                    "device": str(engine.runner.device)}))
    requests: dict[int, Any] = {}

    def sink_for(rid: int) -> Callable[[Event], None]:
        def sink(ev: Event) -> None:
            outbox.append((rid, ev.text, ev.token_ids, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                           ev.error))
            if ev.finish_reason is not None:
                requests.pop(rid, None)

        return sink

    try:
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "submit":
                _, rid, ids, params = msg
                try:
                    req = engine.submit(ids, params, sink_for(rid))
                except (ValueError, QueueFull, RuntimeError) as e:  # checked by the parent: a race at most
                    send(("events", [(rid, "", [], "error", len(ids), 0, f"{type(e).__name__}: {e}")],
                          engine.load()))
                    continue
                requests[rid] = req
                if req.done:  # finished before it was recorded: its sink found nothing to drop
                    requests.pop(rid, None)
            elif msg[0] == "cancel":
                req = requests.get(msg[1])
                if req is not None:
                    engine.cancel(req)
            elif msg[0] == "stop":
                break
    except (EOFError, OSError):  # the parent went away
        pass
    finally:
        engine.stop()
        try:
            send(("stopped",))
        except OSError:
            pass
        conn.close()
