"""``python -m k3.bench serve``: serving on one GPU — decode, prefill, the HTTP server — beside the eager path.

Sections (``--sections``; by default decode, server, prefill, in that order; kdaprobe only when asked):

``decode``   preset ``small``, random bf16 weights, B = 1 / 8 / 64 sequences with 4K-token prompts: tokens/s of the
             ``ModelRunner`` decode step (CUDA graph per batch bucket, sampling on the device), timed as the engine
             runs it (each step's tokens read back one step later), the graph replay alone (device time per step)
             and the kernels of one step (profiler). Beside it, the eager path ``k3.infer.generate`` had:
             ``model(token, state=…)`` per step with the model's input checks, all logits, and a host read of the
             token every step.
``prefill``  ``small`` with every layer KDA and ``small`` (hybrid: 9 KDA + 3 MLA layers), 32K and 1M-token prompts
             through the runner (chunked, only the last position through ``lm_head``): seconds and peak memory beyond
             what was allocated before the call (weights + decode state + latent cache + the ids). Beside it, the
             eager one-call ``model(ids, state=…)`` at 32K.
``server``   ``k3 serve``'s app (uvicorn in this process, the engine in its own) under 1 / 16 / 64 concurrent
             streaming clients (their own process: ``_serve_client.py``), two loads (``SERVER_LOADS``): chat turns
             of 128 prompt tokens and 512 generated, and 1K-token prompts with 256 generated: tokens/s over the
             run, time to first token p50 / p99, failed requests; the same requests submitted to the engine
             in-process (no HTTP) for the ratio.
``kdaprobe`` the first and second KDA split-prefill call of a process (B=1, H=8, T=1M, bf16): peak memory beyond
             inputs and output, and the largest live allocations at the first call's peak with their source lines
             (``torch.cuda.memory`` history).

Isolation: on a GPU every unit (the decode batches together, each prefill model, the server, the probe) runs in its
own child process under a time limit (``--budget-s`` for the whole run). A unit that fails — an exception, a CUDA
fault (which poisons the whole process), a timeout — is recorded as an error row and the parent starts a new child
for the unit's remaining items, so one fault never hides the other numbers. Rows are saved as they come.

Results: ``serve_bench.json`` and ``serve_bench.md`` in ``--out`` (default ``$OUT/serve``). ``--smoke`` runs every
section on tiny CPU shapes in this process to check the script (no timing claims).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import k3.ops.kda as kda_ops
from k3.bench import BenchParser
from k3.config import K3Config
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM
from k3.serve.chat import chat_format
from k3.serve.engine import Engine
from k3.serve.process import EngineProcess
from k3.utils import atomic_write_text

__all__ = ["main"]

SECTIONS = ("decode", "prefill", "server", "kdaprobe")
GIB = 2**30
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _model(preset: str, device: str, **over: Any) -> K3ForCausalLM:
    torch.manual_seed(0)
    cfg = K3Config.from_preset(preset, **over)
    with torch.device(device):
        return K3ForCausalLM(cfg).eval()


def _ids(n: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(1, min(vocab, 256), (n,), device=device, generator=g)


def _peak(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, GiB allocated at the peak beyond what was allocated before, result)."""
    _sync()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    dt = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated() - base) / GIB if torch.cuda.is_available() else float("nan")
    return dt, extra, out


# ----------------------------------------------------------------------------------------------------------- decode
def _runner_decode(model: K3ForCausalLM, B: int, prompt_len: int, steps: int, device: str,
                   profile: bool = True) -> dict[str, Any]:
    runner = ModelRunner(model, max_batch=B, capacity=prompt_len + steps + 8, cuda_graphs="auto")
    for s in range(B):
        runner.admit(s, GREEDY, seed=s)
        runner.prefill(s, _ids(prompt_len, model.config.vocab_size, device, seed=s))
    slots = list(range(B))
    runner.decode(slots).tokens()  # capture (first use of the bucket) and warm up
    _sync()
    lengths = runner.state.lengths.clone()  # prompt + 1: where the replays below start again
    t0 = time.perf_counter()
    prev = None
    for _ in range(steps):  # as the engine runs it: step n's tokens are read after step n + 1 is launched
        cur = runner.decode(slots)
        if prev is not None:
            prev.tokens()
        prev = cur
    prev.tokens()
    dt = time.perf_counter() - t0
    row = {"batch": B, "prompt": prompt_len, "steps": steps, "graphs": runner.use_graphs,
           "tok_s": B * steps / dt, "step_ms": 1e3 * dt / steps}
    b = next(x for x in runner.buckets if x >= B) if runner.use_graphs else B
    step = _step_fn(runner, b)
    runner.state.lengths.copy_(lengths)
    row["replay_ms"] = _device_ms(step, steps)
    if device == "cuda" and profile:
        runner.state.lengths.copy_(lengths)
        row["kernels"] = _kernel_profile(step)
    runner.state.lengths.copy_(lengths)
    del runner
    _free()
    return row


def _step_fn(runner: ModelRunner, b: int) -> Callable[[], None]:
    """One decode step of the bound batch outside the runner's bookkeeping: the bucket's graph replay (the eager
    step without graphs). Every call advances the slots' lengths on the device, so the caller puts them back before
    more calls than the capacity has room for: a latent written past the capacity is an out-of-bounds write."""
    graph = runner._graphs.get((b, "greedy"))
    if graph is not None:
        return graph.replay
    return lambda: runner._step(b, "greedy")


def _device_ms(step: Callable[[], None], n: int) -> float:
    """Milliseconds per call of ``step`` over ``n`` back-to-back calls (CUDA events; wall clock on CPU)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        return 1e3 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    _sync()
    return start.elapsed_time(end) / n


def _kernel_profile(step: Callable[[], None], reps: int = 5, top: int = 15) -> dict[str, Any]:
    """Kernels of one decode step (a graph replay) from the profiler: how many, and the ``top`` by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        _sync()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = per.setdefault(e.name, [0, 0.0])
            n[0] += 1
            n[1] += e.device_time
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    return {"per_step": sum(c for c, _ in per.values()) / reps, "us_per_step": sum(t for _, t in per.values()) / reps,
            "top": [{"name": k[:90], "calls": c / reps, "us": t / reps} for k, (c, t) in rows[:top]]}


@torch.no_grad()
def _eager_decode(model: K3ForCausalLM, B: int, prompt_len: int, steps: int, device: str) -> dict[str, Any]:
    """The eager path: ``model(ids, state=…)`` for the prompt (pieces of 512 for all B rows together), then
    ``model(token, state=…)`` per step with a host read of the token, as ``generate`` did it."""
    state = model.init_state(B, capacity=prompt_len + steps + 8)
    ids = torch.stack([_ids(prompt_len, model.config.vocab_size, device, seed=s) for s in range(B)])
    for a in range(0, prompt_len, 512):
        logits = model(ids[:, a:a + 512], state=state).logits[:, -1]
    tok = logits.argmax(-1)
    for _ in range(2):
        tok = model(tok.view(B, 1), state=state).logits[:, -1].argmax(-1)
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model(tok.view(B, 1), state=state).logits[:, -1].argmax(-1)
        int(tok[0])
    dt = time.perf_counter() - t0
    del state
    _free()
    return {"batch": B, "prompt": prompt_len, "steps": steps, "tok_s": B * steps / dt, "step_ms": 1e3 * dt / steps}


Emit = Callable[[dict[str, Any]], None]


def bench_decode(emit: Emit, model: K3ForCausalLM, B: int, prompt_len: int, steps: int, eager_steps: int,
                 device: str, full: bool = True) -> None:
    """One batch size: the runner's row; with ``full`` (the smallest and largest batch) also the kernel profile and
    the eager path (time is the benchmark's budget)."""
    emit({"section": "decode", "item": B, "path": "runner",
          **_runner_decode(model, B, prompt_len, steps, device, profile=full)})
    if full:
        emit({"section": "decode", "item": B, "path": "eager",
              **_eager_decode(model, B, prompt_len, eager_steps, device)})


# ---------------------------------------------------------------------------------------------------------- prefill
PREFILL_MODELS = {"small all-KDA": {"mla_layers": []}, "small": {}}


def bench_prefill(emit: Emit, preset: str, name: str, lengths: list[int], eager_lengths: list[int], device: str,
                  chunk: int | None) -> None:
    model = _model(preset, device, max_seq_len=max(lengths) + 64, **PREFILL_MODELS[name])
    runner = ModelRunner(model, max_batch=1, capacity=max(lengths) + 64, prefill_chunk=chunk)
    runner.admit(0, GREEDY, seed=0)
    runner.warmup()  # compile and tune at the chunk's shapes, as the server does at start
    for T in lengths:
        ids = _ids(T, model.config.vocab_size, device, seed=T)
        runner.admit(0, GREEDY, seed=0)
        dt, extra, _ = _peak(lambda r=runner, x=ids: r.prefill(0, x).tokens())
        emit({"section": "prefill", "item": name, "model": name, "path": "runner", "tokens": T, "s": dt,
              "tok_s": T / dt, "extra_gib": extra, "chunk": runner.prefill_chunk,
              "state_gib": runner.memory_bytes() / GIB})
        del ids
    del runner
    _free()
    for T in eager_lengths:
        ids = _ids(T, model.config.vocab_size, device, seed=T)[None]

        def eager(st: Any, m: K3ForCausalLM = model, x: torch.Tensor = ids) -> int:
            with torch.no_grad():  # the one-call prefill of the whole prompt into a fresh state
                return int(m(x, state=st).logits[0, -1].argmax())

        row = {"section": "prefill", "item": name, "model": name, "path": "eager", "tokens": T}
        try:
            eager(model.init_state(1, capacity=T + 8))  # untimed: this length's kernels compiled and tuned
            _free()
            state = model.init_state(1, capacity=T + 8)  # allocated before the peak is measured, as the runner's
            dt, extra, _ = _peak(lambda st=state: eager(st))
            del state
            row.update(s=dt, tok_s=T / dt, extra_gib=extra)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        emit(row)
        del ids
        _free()
    del model
    _free()


# ----------------------------------------------------------------------------------------------------------- server
class _IdTokenizer:
    """A stand-in tokenizer for random weights: token i reads as "i "; no stop ids."""

    bos_id = None
    eos_id = None
    stop_ids: set[int] = set()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return "".join(f"{int(i)} " for i in ids).encode()

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode()


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _summary(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == 200 and "error" not in r]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    tokens = sum(r.get("tokens", 0) for r in ok)
    return {"requests": len(rows), "failed": len(rows) - len(ok), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if wall > 0 else float("nan"), "ttft_p50_ms": 1e3 * _percentile(ttft, 0.5),
            "ttft_p99_ms": 1e3 * _percentile(ttft, 0.99)}


def _engine_direct(engine: Any, n: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """The same requests submitted to the engine in this process (no HTTP). Events go to a sink that only counts
    them, as the engine's process does with its outbox: a consumer thread woken for each event would take the
    interpreter lock from the engine's loop 64 times a step and measure that instead."""
    import random

    rng = random.Random(n)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    finished = itertools.count(1)  # next() is atomic: the engine thread alone calls the sink
    all_done = threading.Event()

    def sink(ev: Any) -> None:
        if ev.finish_reason is not None and next(finished) == n:
            all_done.set()

    gpu = _DecodeTimeline(engine.runner) if engine.runner.device.type == "cuda" else None
    t0 = time.perf_counter()
    reqs = [engine.submit([rng.randrange(1, 256) for _ in range(prompt_len)], params, sink) for _ in range(n)]
    all_done.wait()
    wall = time.perf_counter() - t0
    # the engine stamps each request's first token as it reads it back
    rows = [{"status": 200, "tokens": len(r.generated),
             "ttft": None if r.first_token_at is None else r.first_token_at - r.submitted_at} for r in reqs]
    return {**_summary(rows, wall), **(gpu.close() if gpu is not None else {})}


class _DecodeTimeline:
    """CUDA events around every decode launch of ``runner`` (until :meth:`close`): the GPU's time per decode step and
    the gap between one step's end and the next one's start. A gap is the GPU idle waiting for the host, or running
    the prefill launched in between; the median gap is the host's share once every request decodes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.marks = runner, []
        decode = runner.decode

        def timed(slots: Any) -> Any:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            pending = decode(slots)
            b.record()
            self.marks.append((a, b))
            return pending

        runner.decode = timed  # on the instance: the method comes back with the attribute's deletion

    def close(self) -> dict[str, float]:
        del self.runner.decode
        torch.cuda.synchronize()
        m = self.marks
        steps = sorted(a.elapsed_time(b) for a, b in m)
        gaps = sorted(m[i - 1][1].elapsed_time(m[i][0]) for i in range(1, len(m)))
        return {"decode_steps": len(m), "gpu_step_ms_p50": _percentile(steps, 0.5),
                "gpu_gap_ms_p50": _percentile(gaps, 0.5), "gpu_gap_ms_mean": sum(gaps) / max(1, len(gaps))}


# (prompt tokens, generated tokens) per request: a chat turn, where decoding dominates (what the server adds to the
# engine's decode shows), and long prompts, where prefill takes most of the run
SERVER_LOADS = [(128, 512), (1024, 256)]
# streams per load-generator process: the clients' Python must not be what limits the server's rate (one process
# reading 64 streams needs most of a core at the server's full rate)
CLIENT_STREAMS = 16


def _server_model(preset: str, device: str, max_seq_len: int) -> tuple[K3ForCausalLM, _IdTokenizer]:
    """The server's model and tokenizer, built in the engine's process (``EngineProcess``)."""
    model = _model(preset, device, max_seq_len=max_seq_len)
    return model, _IdTokenizer(model.config.vocab_size)


def bench_server(emit: Emit, preset: str, clients: list[int], loads: list[tuple[int, int]], device: str) -> None:
    import uvicorn

    from k3.serve.api import create_app
    from k3.serve.server import bind_socket

    longest = max(p + t for p, t in loads)
    max_batch = max(clients)
    kw = dict(max_batch=max_batch, max_queue=max(clients), capacity=longest + 8)
    model, tok = _server_model(preset, device, longest + 64)
    engine = Engine(model, tok, **kw)
    engine.start()
    # untimed: every decode bucket captured, the prefill shapes compiled and tuned, before any row is timed
    for prompt_len, _ in loads:
        for n in sorted(set(clients)):
            _engine_direct(engine, n, prompt_len, 4)
    for prompt_len, max_tokens in loads:  # the engine alone, in this process (no HTTP)
        for n in clients:
            emit({"section": "server", "item": "server", "path": "engine", "clients": n, "prompt": prompt_len,
                  "max_tokens": max_tokens, **_engine_direct(engine, n, prompt_len, max_tokens)})
    engine.stop()
    del engine, model
    _free()
    # the server as ``k3 serve`` runs it: the engine in its own process, uvicorn in this one
    engine = EngineProcess(_server_model, (preset, device, longest + 64), tok, **kw).start()
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "small", chat_format(tok)), log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    script = str(Path(__file__).with_name("_serve_client.py"))  # run as a file: no k3 (torch) import to wait for

    def client_processes(n: int) -> int:
        return -(-n // CLIENT_STREAMS)

    def client(n: int, prompt_len: int, max_tokens: int) -> tuple[list[dict[str, Any]], str]:
        """``n`` streams from ``client_processes(n)`` processes → (one row per request, errors)."""
        procs = client_processes(n)
        shares = [n // procs + (i < n % procs) for i in range(procs)]
        ps = [subprocess.Popen([sys.executable, script, url, "small", str(k), str(prompt_len), str(max_tokens),
                                str(n * 100 + i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i, k in enumerate(shares)]
        rows, errors = [], ""
        for p in ps:
            out, err = p.communicate(timeout=900)
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if p.returncode != 0:
                errors += err[-2000:]
        return rows, errors

    try:
        # untimed: the app's first request (its lazy setup), then the child's prefill shapes of every row
        client(1, 8, 2)
        for prompt_len, _ in loads:
            for n in sorted(set(clients)):
                client(n, prompt_len, 4)
        for prompt_len, max_tokens in loads:
            for n in clients:
                t0 = time.perf_counter()
                reqs, errors = client(n, prompt_len, max_tokens)
                wall = time.perf_counter() - t0
                row = {"section": "server", "item": "server", "path": "http", "clients": n, "prompt": prompt_len,
                       "max_tokens": max_tokens, "client_processes": client_processes(n)}
                if errors or len(reqs) != n:
                    row["error"] = errors or f"{len(reqs)} of {n} requests reported"
                else:
                    span = max(r.get("end", 0.0) for r in reqs) - min(r["start"] for r in reqs)
                    row.update(_summary(reqs, span), client_wall_s=wall)
                emit(row)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.stop()


# --------------------------------------------------------------------------------------------------------- kdaprobe
def bench_kdaprobe(emit: Emit, T: int, H: int, device: str) -> None:
    """Peak memory of the first and second KDA prefill call of this process, and who holds the first call's peak."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, f = (r(1, T, H, 128) for _ in range(4))
    b = r(1, T, H)
    A_log, dt_bias = torch.zeros(H, device=device), torch.zeros(H * 128, device=device)

    def call() -> Any:
        with torch.no_grad():
            return kda_ops.chunk_kda(q, k, v, f, b, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                     lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)

    out: dict[str, Any] = {"section": "kdaprobe", "item": "kdaprobe", "T": T, "H": H}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    for i in (1, 2):
        dt, extra, res = _peak(call)
        out[f"call{i}"] = {"s": dt, "extra_gib_incl_output": extra}
        if cuda and i == 1:
            out["call1"]["top_live_at_peak"] = _live_at_peak(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        del res
    emit(out)


def _live_at_peak(snapshot: dict) -> list[dict[str, Any]]:
    """Replay the allocator trace: the live blocks at the largest total, biggest first, with their k3 frames."""
    trace = [e for dev in snapshot.get("device_traces", []) for e in dev]
    live: dict[int, dict] = {}
    total = best = 0
    best_live: list[dict] = []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    rows = []
    for e in sorted(best_live, key=lambda x: -x["size"])[:12]:
        frames = [f"{fr['filename'].split('k3/')[-1]}:{fr['line']} {fr['name']}" for fr in e.get("frames", [])
                  if "/k3/" in fr.get("filename", "")][:4]
        rows.append({"gib": e["size"] / GIB, "stream": e.get("stream"), "frames": frames})
    return rows


# ------------------------------------------------------------------------------------------------------------ report
def _nan(r: dict[str, Any], k: str) -> float:
    v = r.get(k)
    return float("nan") if v is None else float(v)


def _markdown(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Serving benchmark\n\n{header.get('gpu', '?')}, torch {header['torch']}, triton {header['triton']}, "
             f"{header['date']}, {header.get('cpus', '?')} CPUs, uvicorn on {header.get('uvicorn_http', '?')}. "
             f"Command: `{header['command']}`. Preset `{header.get('preset', 'small')}`, random weights in the "
             f"preset's dtype.\n"]
    dec = [r for r in rows if r.get("section") == "decode" and "error" not in r]
    if dec:
        lines += ["## Decode (tokens/s; 4K-token prompts)\n",
                  "| batch | runner tok/s | step ms (host loop) | graph replay ms | eager tok/s | eager step ms | × |",
                  "|---|---|---|---|---|---|---|"]
        by = {(r["path"], r["batch"]): r for r in dec}
        for B in sorted({r["batch"] for r in dec}):
            a, e = by.get(("runner", B), {}), by.get(("eager", B), {})
            lines.append(f"| {B} | {_nan(a, 'tok_s'):,.0f} | {_nan(a, 'step_ms'):.3f} | {_nan(a, 'replay_ms'):.3f} | "
                         f"{_nan(e, 'tok_s'):,.0f} | {_nan(e, 'step_ms'):.2f} | "
                         f"{_nan(a, 'tok_s') / _nan(e, 'tok_s'):.1f} |")
    for r in dec:
        k = r.get("kernels")
        if k:
            lines += [f"\nKernels of one step at batch {r['batch']}: {k['per_step']:.0f} launches, "
                      f"{k['us_per_step']:.0f} µs of kernel time; the largest:\n",
                      "| kernel | per step | µs |", "|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['calls']:.0f} | {t['us']:.1f} |" for t in k["top"][:10]]
    pre = [r for r in rows if r.get("section") == "prefill"]
    if pre:
        lines += ["\n## Prefill (one sequence; memory = peak allocated beyond weights + decode state + cache + ids)\n",
                  "| model | path | tokens | s | tokens/s | + GiB | chunk |", "|---|---|---|---|---|---|---|"]
        for r in pre:
            if "error" in r:
                err = r["error"][:80]
                lines.append(f"| {r['item']} | {r.get('path') or ''} | {r.get('tokens', 0):,} | {err} | | | |")
                continue
            lines.append(f"| {r['model']} | {r['path']} | {r['tokens']:,} | {r['s']:.2f} | {r['tok_s']:,.0f} | "
                         f"{r['extra_gib']:.2f} | {r.get('chunk', '')} |")
    srv = [r for r in rows if r.get("section") == "server" and "clients" in r]
    if srv:
        lines += ["\n## Server (streaming clients; tokens/s counts generated tokens; engine rows on a GPU: the GPU's "
                  "time per decode step and the gap between steps, median)\n",
                  "| prompt + generated tokens | path | clients | tok/s | TTFT p50 ms | TTFT p99 ms | failed | "
                  "GPU step ms | gap ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in srv:
            load = f"{r.get('prompt', '?')} + {r.get('max_tokens', '?')}"
            if "error" in r:
                lines.append(f"| {load} | {r['path']} | {r['clients']} | error | | | | | |")
                continue
            gpu = (f"{r['gpu_step_ms_p50']:.3f} | {r['gpu_gap_ms_p50']:.4f}" if "gpu_step_ms_p50" in r else " | ")
            lines.append(f"| {load} | {r['path']} | {r['clients']} | {r['tok_s']:,.0f} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['ttft_p99_ms']:.1f} | {r['failed']} | {gpu} |")
    for p in (r for r in rows if r.get("section") == "kdaprobe" and "call1" in r):
        lines += [f"\n## KDA prefill memory, first vs second call of the process (B=1, H={p['H']}, T={p['T']:,})\n",
                  f"first call: +{p['call1']['extra_gib_incl_output']:.2f} GiB, {p['call1']['s']:.2f} s; "
                  f"second call: +{p['call2']['extra_gib_incl_output']:.2f} GiB, {p['call2']['s']:.3f} s\n"]
        for row in p["call1"].get("top_live_at_peak", [])[:8]:
            lines.append(f"- {row['gib']:.2f} GiB (stream {row['stream']}): {' ← '.join(row['frames'])}")
    errors = [r for r in rows if "error" in r and r.get("path") is None]
    if errors:
        lines += ["\n## Failed\n"] + [f"- {r['section']} {r['item']}: {r['error'][:300]}" for r in errors]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------- runs
class Rows:
    """Result rows: appended to ``path`` (when given) as they come, printed when ``echo``, kept in ``rows``."""

    def __init__(self, path: str | None = None, echo: bool = True) -> None:
        self.path, self.echo, self.rows = path, echo, []

    def __call__(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.echo:
            print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _plan(smoke: bool) -> dict[str, Any]:
    """Sizes of every section (``smoke``: tiny CPU shapes)."""
    if smoke:
        return dict(preset="tiny", batches=[1, 3], prompt=64, steps=12, eager_steps=2, lengths=[300, 700],
                    eager_lengths=[300], clients=[1, 3], loads=[(8, 6), (16, 4)], probe=(256, 2))
    return dict(preset="small", batches=[1, 8, 64], prompt=4096, steps=128, eager_steps=8,
                lengths=[32768, 1 << 20], eager_lengths=[32768], clients=[1, 16, 64], loads=SERVER_LOADS,
                probe=(1 << 20, 8))


def _units(sections: list[str], plan: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """(section, items) in run order. An item is what a failure skips: a decode batch, a prefill model."""
    items = {"decode": plan["batches"], "prefill": list(PREFILL_MODELS)}
    return [(s, items.get(s, [s])) for s in ("kdaprobe", "decode", "server", "prefill") if s in sections]


def run_unit(emit: Emit, section: str, items: list[Any], plan: dict[str, Any], device: str,
             chunk: int | None) -> None:
    """The unit's items in order, each followed by a ``done`` marker row."""
    p = plan
    model = _model(p["preset"], device, max_seq_len=p["prompt"] + p["steps"] + 64) if section == "decode" else None
    for item in items:
        if section == "decode":
            full = item in (min(p["batches"]), max(p["batches"]))
            bench_decode(emit, model, item, p["prompt"], p["steps"], p["eager_steps"], device, full)
        elif section == "prefill":
            bench_prefill(emit, p["preset"], item, p["lengths"], p["eager_lengths"], device, chunk)
        elif section == "server":
            bench_server(emit, p["preset"], p["clients"], p["loads"], device)
        else:
            bench_kdaprobe(emit, *p["probe"], device)
        emit({"section": section, "item": item, "path": "done"})


def _error_row(section: str, item: Any, error: str) -> dict[str, Any]:
    return {"section": section, "item": item, "path": None, "error": error}


def run_in_process(emit: Emit, units: list[tuple[str, list[Any]]], plan: dict[str, Any], device: str,
                   chunk: int | None) -> None:
    """Every item here (CPU smoke runs); an exception is recorded as the item's error row, the others still run."""
    for section, items in units:
        for item in items:
            try:
                run_unit(emit, section, [item], plan, device, chunk)
            except Exception as e:  # noqa: BLE001 — a failed item is a result
                import traceback

                traceback.print_exc()
                emit(_error_row(section, item, f"{type(e).__name__}: {e}"))


def run_isolated(emit: Emit, units: list[tuple[str, list[Any]]], args: list[str], deadline: float,
                 tmp_dir: str) -> None:
    """Each unit in a child process (``args``: its extra arguments) with the time left. When a child fails
    (exception, CUDA fault, timeout), the item it was on is recorded as failed and the unit's remaining items get a
    new child."""
    for section, todo in units:
        while todo:
            left = deadline - time.monotonic()
            if left < 5:
                for item in todo:
                    emit(_error_row(section, item, "not run: the time budget is spent"))
                break
            path = os.path.join(tmp_dir, f".rows_{section}_{os.getpid()}.jsonl")
            if os.path.exists(path):
                os.remove(path)
            cmd = [sys.executable, "-m", "k3.bench", "serve", "--child", section, "--items", json.dumps(todo),
                   "--rows", path, *args]
            try:
                rc = subprocess.run(cmd, timeout=left).returncode
                why = f"the child process exited with status {rc} (its log above)"
            except subprocess.TimeoutExpired:
                rc, why = -1, f"timed out: the run's time budget ended {left:.0f} s into this unit"
            got = []
            if os.path.exists(path):
                with open(path) as f:
                    got = [json.loads(line) for line in f if line.strip()]
                os.remove(path)
            for row in got:
                emit(row)
            done = [r["item"] for r in got if r.get("path") == "done"]
            rest = [it for it in todo if it not in done]
            if rc == 0 or not rest:
                break
            emit(_error_row(section, rest[0], why))
            todo = rest[1:]


def _header(device: str) -> dict[str, Any]:
    import triton

    import importlib.util

    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    # uvicorn's parser and event loop: httptools and uvloop when installed (``uvicorn[standard]``), else h11, asyncio
    have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    http = f"{'httptools' if have('httptools') else 'h11'} + {'uvloop' if have('uvloop') else 'asyncio'}"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, host=platform.node(),
                cpus=os.cpu_count(), uvicorn_http=http, date=datetime.date.today().isoformat())


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="decode,server,prefill", help=f"comma-separated of {', '.join(SECTIONS)}")
    p.add_argument("--out", default=None, help="results folder (default $OUT/serve)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes, in this process: checks the script")
    p.add_argument("--prefill-chunk", type=int, default=None, help="override the automatic prefill chunk")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock limit of the whole run (children)")
    p.add_argument("--isolated", action="store_true", help="every unit in a child process (the default on a GPU)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--items", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        torch.set_num_threads(1)  # tiny ops: OpenMP threads only cost
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    plan = _plan(a.smoke)
    if a.child:  # one unit of run_isolated: rows to --rows; a failure is this process's exit status
        emit = Rows(a.rows)
        emit({"section": a.child, "item": None, "path": "header", **_header(device)})
        run_unit(emit, a.child, json.loads(a.items), plan, device, a.prefill_chunk)
        return 0
    sections = [s for s in a.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    out_dir = a.out or os.path.join(os.environ.get("OUT", "."), "serve")
    os.makedirs(out_dir, exist_ok=True)
    command = "python -m k3.bench serve " + " ".join(argv if argv is not None else sys.argv[1:])
    header = {**_header("cpu"), "command": command, "preset": plan["preset"]}
    isolated = device == "cuda" or a.isolated
    rows = Rows(echo=not isolated)  # a child prints its own rows

    def emit(row: dict[str, Any]) -> None:
        if row.get("path") == "header":  # the children's: the GPU's name
            header.update({k: v for k, v in row.items() if k not in ("section", "item", "path")})
        elif row.get("path") != "done":
            rows(row)
            _save(out_dir, header, rows.rows)

    units = _units(sections, plan)
    if isolated:
        extra = ["--prefill-chunk", str(a.prefill_chunk)] if a.prefill_chunk else []
        extra += ["--smoke"] if a.smoke else []
        run_isolated(emit, units, extra, time.monotonic() + a.budget_s, out_dir)
    else:
        header.update(_header(device))
        run_in_process(emit, units, plan, device, a.prefill_chunk)
    md = _save(out_dir, header, rows.rows)
    print(md)
    return 1 if any("error" in r for r in rows.rows) else 0


def _save(out_dir: str, header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """serve_bench.json and serve_bench.md (written whole each time: a run cut short keeps what it had)."""
    md = _markdown(header, rows)
    for name, text in (("serve_bench.json", json.dumps({"header": header, "rows": rows}, indent=1)),
                       ("serve_bench.md", md)):
        atomic_write_text(os.path.join(out_dir, name), text)
    return md


if __name__ == "__main__":
    sys.exit(main())
