"""Load generator of ``python -m k3.bench serve`` (its own process, so the clients' Python does not share the
server's GIL): N concurrent streaming ``/v1/completions`` requests with token-id prompts, one JSON line per request
on stdout (status, time to first token, start and end times on the machine's monotonic clock — ``time.perf_counter``
is ``CLOCK_MONOTONIC`` on Linux, one clock for every process — and completion tokens).

    python -m k3.bench._serve_client URL MODEL N PROMPT_LEN MAX_TOKENS SEED

The client speaks HTTP/1.1 over asyncio streams itself and parses only what it measures (the first chunk that holds
text, the final usage chunk), like wrk rather than an SDK. On a 2-core CPU, for 64 streams of 512 chunks, an httpx
client parsing every chunk took 1.7 s of CPU against the server's 0.8 s and read 22.9 K chunks/s from a stand-in
engine emitting 28 K+; this one takes 1.1 s and reads 28.3 K. The benchmark still spreads its streams over several
processes, so that no client process is what limits the rate.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from urllib.parse import urlsplit


class _HTTPError(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    return status, headers


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The response body as it arrives (chunked transfer encoding or a plain body to the connection's end)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    else:
        n = int(headers.get("content-length", "-1"))
        yield await (reader.readexactly(n) if n >= 0 else reader.read())


async def _one(host: str, port: int, body: bytes) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
    status = 0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Accept: text/event-stream\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (host.encode(), port, len(body), body))
        await writer.drain()
        status, headers = await _read_head(reader)
        buf = b""
        async for piece in _body_pieces(reader, headers):
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                if first is None or b'"usage"' in ev:
                    chunk = json.loads(ev[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("error"):
                        raise _HTTPError(json.dumps(chunk["error"]))
        if status != 200:
            raise _HTTPError(f"HTTP {status}: {buf[:200]!r}")
    except Exception as e:  # noqa: BLE001 — a failed request is a result of the benchmark
        return {"status": status, "error": f"{type(e).__name__}: {e}", "start": start}
    finally:
        if writer is not None:
            writer.close()
    return {"status": status, "start": start, "ttft": None if first is None else first - start,
            "end": time.perf_counter(), "tokens": tokens}


async def _main(url: str, model: str, n: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    bodies = [json.dumps({"model": model, "prompt": [rng.randrange(1, 256) for _ in range(prompt_len)],
                          "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for _ in range(n)]
    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    # untimed: the server answers at all (and this process's first connection is set up) before the clock starts
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (host.encode(), port))
    status, _ = await _read_head(reader)
    writer.close()
    if status != 200:
        raise SystemExit(f"the server's /health answered {status}")
    rows = await asyncio.gather(*(_one(host, port, b) for b in bodies))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    u, m, n, pl, mt, s = sys.argv[1:7]
    asyncio.run(_main(u, m, int(n), int(pl), int(mt), int(s)))
