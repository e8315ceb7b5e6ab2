"""``k3 serve``: start the engine in its own process on a run or a released checkpoint, serve the API with uvicorn.

The listening socket is bound here, before uvicorn starts, so a busy port or a bad host is reported as one
``k3: error:`` line; ``--port 0`` lets the system pick a free port (the ready line on stdout names it).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import torch
import uvicorn

from k3.ckpt.released import load_pretrained
from k3.ckpt.run import find_checkpoint, load_checkpoint, load_tokenizer
from k3.data.k3_tokenizer import load_k3_tokenizer
from k3.serve.api import create_app
from k3.serve.chat import chat_format, find_chat_template
from k3.serve.process import EngineProcess

__all__ = ["serve", "resolve_source", "load_engine_model", "bind_socket"]


def resolve_source(run: str | None, model_path: str | None, dtype: str | None) -> tuple[tuple[str, str], Any,
                                                                                          list[Path], str]:
    """What to serve, resolved in the server's process before the engine's starts: ``((kind, path), tokenizer,
    folders that may hold a chat template, default model name)``. A run dir resolves to its newest checkpoint
    here, so the engine loads the one whose tokenizer the server uses."""
    if run is not None:
        if dtype is not None:
            raise ValueError("--dtype applies to --model only; drop it with --run")
        ckpt = find_checkpoint(run)
        return ("run", str(ckpt)), load_tokenizer(ckpt), [ckpt, ckpt / "tokenizer_files"], Path(run).resolve().name
    return ("model", model_path), load_k3_tokenizer(model_path), [Path(model_path)], Path(model_path).resolve().name


def load_engine_model(source: tuple[str, str], device: Any, dtype: str | None, force_memory: bool,
                      max_seq_len: int | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``source`` (from :func:`resolve_source`): runs in the engine's process."""
    kind, path = source
    if kind == "run":
        ck = load_checkpoint(path, device=device, force_memory=force_memory)
        model, tok = ck["model"], ck["tokenizer"]
    else:
        tok = load_k3_tokenizer(path)
        model = load_pretrained(path, device=device, dtype=getattr(torch, dtype) if dtype else None,
                                force_memory=force_memory).eval()
    if max_seq_len is not None and max_seq_len > model.config.max_seq_len:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    if torch.device(device).type == "cpu" and model.config.hidden_size <= 512:
        torch.set_num_threads(1)  # tiny models: one CPU thread (``k3.train.trainer.cpu_threads`` says why)
    return model, tok


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (IPv4 or IPv6); ``ValueError`` with the reason when it cannot be."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(run: str | None, model_path: str | None, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          max_queue: int = 64, max_seq_len: int | None = None, prefill_chunk: int | None = None,
          name: str | None = None, device: Any = "cpu", dtype: str | None = None, force_memory: bool = False) -> int:
    """Serve until interrupted (SIGINT/SIGTERM: graceful shutdown). Returns the exit status. The engine runs in
    its own process (``k3.serve.process`` says why); this one runs the HTTP side."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    sock = bind_socket(host, port)  # before the (slow) model load: a busy port fails at once
    engine = None
    try:
        source, tok, folders, default_name = resolve_source(run, model_path, dtype)
        folder = next((f for f in folders if find_chat_template(f) is not None), None)
        chat = chat_format(tok, folder)
        engine = EngineProcess(load_engine_model, (source, device, dtype, force_memory, max_seq_len), tok,
                               max_batch=max_batch, max_queue=max_queue, capacity=max_seq_len,
                               prefill_chunk=prefill_chunk).start()
        app = create_app(engine, name or default_name, chat)
        bound = sock.getsockname()
        print(f"k3: serving {name or default_name!r} on http://{host}:{bound[1]} (OpenAI API under /v1; "
              f"{engine.max_batch} slots, context {engine.capacity} tokens, device {engine.device})", flush=True)
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if engine is not None:
            engine.stop()
        sock.close()
    sys.stdout.flush()
    return 0
