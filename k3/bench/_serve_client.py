"""Load generator of ``python -m k3.bench serve`` (its own process, so the clients' Python does not share the
server's GIL): N concurrent streaming ``/v1/completions`` requests with token-id prompts, one JSON line per request
on stdout (status, time to first token, end time, completion tokens).

    python -m k3.bench._serve_client URL MODEL N PROMPT_LEN MAX_TOKENS SEED
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time


async def _one(client, url: str, body: dict, t0: float) -> dict:
    start = time.perf_counter() - t0
    first = None
    tokens = 0
    status = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 — a failed request is a result of the benchmark
        return {"status": status, "error": f"{type(e).__name__}: {e}", "start": start}
    return {"status": status, "start": start, "ttft": None if first is None else first - start,
            "end": time.perf_counter() - t0, "tokens": tokens}


async def _main(url: str, model: str, n: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    import httpx

    rng = random.Random(seed)
    bodies = [{"model": model, "prompt": [rng.randrange(1, 256) for _ in range(prompt_len)], "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
              for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        # untimed: the client's own first-request setup (lazy imports, the connection pool), not the server's
        (await client.get(f"{url}/health", timeout=60)).raise_for_status()
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(_one(client, url, b, t0) for b in bodies))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    u, m, n, pl, mt, s = sys.argv[1:7]
    asyncio.run(_main(u, m, int(n), int(pl), int(mt), int(s)))
