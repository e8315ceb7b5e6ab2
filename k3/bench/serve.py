"""``python -m k3.bench serve``: serving on one GPU — decode, prefill, the HTTP server — beside the eager path.

Sections (``--sections``; run in the order decode, prefill, server, with kdaprobe first when asked):

``decode``   preset ``small``, random bf16 weights, B = 1 / 8 / 64 sequences with 4K-token prompts: tokens/s of the
             ``ModelRunner`` decode step (CUDA graph per batch bucket, sampling on the device), timed as the engine
             runs it (each step's tokens read back one step later), and the graph replay alone (device time per
             step). Beside it, the eager path ``k3.infer.generate`` had: ``model(token, state=…)`` per step with the
             model's input checks, all logits, and a host read of the token every step.
``prefill``  ``small`` (hybrid: 9 KDA + 3 MLA layers) and ``small`` with every layer KDA, 32K / 128K / 1M-token
             prompts through the runner (chunked, only the last position through ``lm_head``): seconds and peak
             memory beyond what was allocated before the call (weights + decode state + latent cache + the ids).
             Beside it, the eager one-call ``model(ids, state=…)`` at 32K (and 128K all-KDA).
``server``   ``k3 serve``'s app (uvicorn in this process, the engine thread behind it) under 1 / 16 / 64 concurrent
             streaming clients (their own process: ``_serve_client.py``), 1K-token prompts, 256 tokens each:
             tokens/s over the run, time to first token p50 / p99, failed requests; the same requests submitted to
             the engine in-process (no HTTP) for the ratio.
``kdaprobe`` the first and second KDA split-prefill call of a process (B=1, H=8, T=1M, bf16): peak memory beyond
             inputs and output, and the largest live allocations at the first call's peak with their source lines
             (``torch.cuda.memory`` history). Run it in a fresh process (first in ``bench/gpu/serve.sh``).

Results: ``serve_bench.json`` and ``serve_bench.md`` in ``--out`` (default ``$OUT/serve``). ``--smoke`` runs every
section on tiny CPU shapes to check the script (no timing claims).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
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
def _runner_decode(model: K3ForCausalLM, B: int, prompt_len: int, steps: int, device: str) -> dict[str, Any]:
    runner = ModelRunner(model, max_batch=B, capacity=prompt_len + steps + 8, cuda_graphs="auto")
    for s in range(B):
        runner.admit(s, GREEDY, seed=s)
        runner.prefill(s, _ids(prompt_len, model.config.vocab_size, device, seed=s))
    slots = list(range(B))
    runner.decode(slots).tokens()  # capture (first use of the bucket) and warm up
    _sync()
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
    b = next(x for x in runner.buckets if x >= B)
    graph = runner._graphs.get((b, "greedy"))
    if graph is not None:  # device time of the step alone: back-to-back replays
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        _sync()
        row["replay_ms"] = start.elapsed_time(end) / steps
        row["kernels"] = _kernel_profile(graph)
    del runner
    _free()
    return row


def _kernel_profile(graph: Any, reps: int = 5, top: int = 15) -> dict[str, Any]:
    """Kernels of one decode step (a graph replay) from the profiler: how many, and the ``top`` by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
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


def bench_decode(model: K3ForCausalLM, batches: list[int], prompt_len: int, steps: int, eager_steps: int,
                 device: str) -> list[dict[str, Any]]:
    rows = []
    for B in batches:
        row = {"path": "runner", **_runner_decode(model, B, prompt_len, steps, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        row = {"path": "eager", **_eager_decode(model, B, prompt_len, eager_steps, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------- prefill
def bench_prefill(preset: str, lengths: list[int], eager_lengths: dict[str, list[int]], device: str,
                  chunk: int | None) -> list[dict[str, Any]]:
    rows = []
    for name, over in (("small", {}), ("small all-KDA", {"mla_layers": []})):
        model = _model(preset, device, max_seq_len=max(lengths) + 64, **over)
        runner = ModelRunner(model, max_batch=1, capacity=max(lengths) + 64, prefill_chunk=chunk)
        runner.admit(0, GREEDY, seed=0)
        runner.prefill(0, _ids(min(8192, max(lengths)), model.config.vocab_size, device)).tokens()  # compile, warm
        auto = runner.prefill_chunk
        runs = [(T, auto) for T in lengths]
        if chunk is None and over:  # all-KDA: the longest prompt again at twice the chunk (time vs memory)
            runs.append((max(lengths), 2 * auto))
        for T, c in runs:
            ids = _ids(T, model.config.vocab_size, device, seed=T)
            runner.prefill_chunk = c
            runner.admit(0, GREEDY, seed=0)
            dt, extra, _ = _peak(lambda r=runner, x=ids: r.prefill(0, x).tokens())
            row = {"model": name, "path": "runner", "tokens": T, "s": dt, "tok_s": T / dt, "extra_gib": extra,
                   "chunk": c, "state_gib": runner.memory_bytes() / GIB}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del ids
        del runner
        _free()
        for T in eager_lengths.get(name, []):
            ids = _ids(T, model.config.vocab_size, device, seed=T)[None]
            state = model.init_state(1, capacity=T + 8)

            def eager(m: K3ForCausalLM = model, x: torch.Tensor = ids, st: Any = state) -> int:
                with torch.no_grad():
                    return int(m(x, state=st).logits[0, -1].argmax())

            try:
                dt, extra, _ = _peak(eager)
                row = {"model": name, "path": "eager", "tokens": T, "s": dt, "tok_s": T / dt, "extra_gib": extra}
            except torch.OutOfMemoryError:
                row = {"model": name, "path": "eager", "tokens": T, "error": "out of memory"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del state, ids
            _free()
        del model
        _free()
    return rows


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
    """The same requests submitted to the engine in this process (no HTTP)."""
    import random

    rng = random.Random(n)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.submit([rng.randrange(1, 256) for _ in range(prompt_len)], params) for _ in range(n)]
    rows = []
    for r in reqs:  # the engine stamps each request's first token as it reads it back
        while True:
            ev = r.events.get()
            if ev.finish_reason is not None:
                break
        rows.append({"status": 200, "tokens": ev.completion_tokens,
                     "ttft": None if r.first_token_at is None else r.first_token_at - r.submitted_at})
    return _summary(rows, time.perf_counter() - t0)


def bench_server(model: K3ForCausalLM, clients: list[int], prompt_len: int, max_tokens: int,
                 max_batch: int) -> list[dict[str, Any]]:
    import uvicorn

    from k3.serve.api import create_app
    from k3.serve.server import bind_socket

    tok = _IdTokenizer(model.config.vocab_size)
    engine = Engine(model, tok, max_batch=max_batch, max_queue=max(clients), capacity=prompt_len + max_tokens + 8)
    engine.start()
    rows = []
    for n in clients:  # the engine alone first (the server's app stops the engine when it shuts down)
        row = {"path": "engine", "clients": n, **_engine_direct(engine, n, prompt_len, max_tokens)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "small", chat_format(tok)), log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        for n in clients:
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "k3.bench._serve_client", url, "small", str(n), str(prompt_len),
                                  str(max_tokens), str(n)], capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t0
            reqs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or len(reqs) != n:
                row = {"path": "http", "clients": n, "error": out.stderr[-2000:]}
            else:
                span = max(r.get("end", 0.0) for r in reqs) - min(r["start"] for r in reqs)
                row = {"path": "http", "clients": n, **_summary(reqs, span), "client_wall_s": wall}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.stop()
    return rows


# --------------------------------------------------------------------------------------------------------- kdaprobe
def bench_kdaprobe(T: int, H: int, device: str) -> dict[str, Any]:
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

    out: dict[str, Any] = {"T": T, "H": H}
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
    print(json.dumps(out), flush=True)
    return out


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
def _markdown(header: dict[str, Any], res: dict[str, Any]) -> str:
    lines = [f"# Serving benchmark\n\n{header['gpu']}, torch {header['torch']}, triton {header['triton']}, "
             f"{header['date']}. Command: `{header['command']}`. Preset `small`, random bf16 weights.\n"]
    if res.get("decode"):
        lines += ["## Decode (tokens/s; 4K-token prompts)\n",
                  "| batch | runner tok/s | step ms (host loop) | graph replay ms | eager tok/s | eager step ms | × |",
                  "|---|---|---|---|---|---|---|"]
        by = {(r["path"], r["batch"]): r for r in res["decode"]}
        for B in sorted({r["batch"] for r in res["decode"]}):
            a, e = by.get(("runner", B), {}), by.get(("eager", B), {})
            ratio = a.get("tok_s", float("nan")) / e.get("tok_s", float("nan"))
            lines.append(f"| {B} | {a.get('tok_s', float('nan')):,.0f} | {a.get('step_ms', float('nan')):.3f} | "
                         f"{a.get('replay_ms', float('nan')):.3f} | {e.get('tok_s', float('nan')):,.0f} | "
                         f"{e.get('step_ms', float('nan')):.2f} | {ratio:.1f} |")
    for r in res.get("decode") or []:
        k = r.get("kernels")
        if k:
            lines += [f"\nKernels of one step at batch {r['batch']}: {k['per_step']:.0f} launches, "
                      f"{k['us_per_step']:.0f} µs of kernel time; the largest:\n", "| kernel | per step | µs |", "|---|---|---|"]
            lines += [f"| `{t['name']}` | {t['calls']:.0f} | {t['us']:.1f} |" for t in k["top"][:10]]
    if res.get("prefill"):
        lines += ["\n## Prefill (one sequence; memory = peak allocated beyond weights + decode state + cache + ids)\n",
                  "| model | path | tokens | s | tokens/s | + GiB | chunk |", "|---|---|---|---|---|---|---|"]
        for r in res["prefill"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['path']} | {r['tokens']:,} | {r['error']} | | | |")
                continue
            lines.append(f"| {r['model']} | {r['path']} | {r['tokens']:,} | {r['s']:.2f} | {r['tok_s']:,.0f} | "
                         f"{r['extra_gib']:.2f} | {r.get('chunk', '')} |")
    if res.get("server"):
        lines += ["\n## Server (streaming clients; 1K-token prompts, 256 tokens each)\n",
                  "| path | clients | tok/s | TTFT p50 ms | TTFT p99 ms | failed |", "|---|---|---|---|---|---|"]
        for r in res["server"]:
            if "error" in r:
                lines.append(f"| {r['path']} | {r['clients']} | error | | | |")
                continue
            lines.append(f"| {r['path']} | {r['clients']} | {r['tok_s']:,.0f} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['ttft_p99_ms']:.1f} | {r['failed']} |")
    if res.get("kdaprobe"):
        p = res["kdaprobe"]
        lines += [f"\n## KDA prefill memory, first vs second call of the process (B=1, H={p['H']}, T={p['T']:,})\n",
                  f"call 1: +{p['call1']['extra_gib_incl_output']:.2f} GiB, {p['call1']['s']:.2f} s; "
                  f"call 2: +{p['call2']['extra_gib_incl_output']:.2f} GiB, {p['call2']['s']:.3f} s\n"]
        for row in p["call1"].get("top_live_at_peak", [])[:8]:
            lines.append(f"- {row['gib']:.2f} GiB (stream {row['stream']}): {' ← '.join(row['frames'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="decode,prefill,server", help=f"comma-separated of {', '.join(SECTIONS)}")
    p.add_argument("--out", default=None, help="results folder (default $OUT/serve)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes: checks the script, no timing claims")
    p.add_argument("--prefill-chunk", type=int, default=None, help="override the automatic prefill chunk")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    out_dir = args.out or os.path.join(os.environ.get("OUT", "."), "serve")
    os.makedirs(out_dir, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:  # tiny model, short prompts, few steps: every code path, seconds on a CPU
        torch.set_num_threads(1)  # tiny ops: OpenMP threads only cost
        preset, batches, prompt, steps, eager_steps = "tiny", [1, 3], 64, 4, 2
        lengths, eager_lengths, clients, s_prompt, s_tokens = [300, 700], {"small": [300]}, [1, 3], 16, 4
        probe = (256, 2)
    else:
        preset, batches, prompt, steps, eager_steps = "small", [1, 8, 64], 4096, 128, 16
        lengths, eager_lengths = [32768, 131072, 1048576], {"small": [32768], "small all-KDA": [32768, 131072]}
        clients, s_prompt, s_tokens, probe = [1, 16, 64], 1024, 256, (1 << 20, 8)
    import triton

    header = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)", torch=torch.__version__,
                  triton=triton.__version__, host=platform.node(), date=datetime.date.today().isoformat(),
                  command="python -m k3.bench serve " + " ".join(argv if argv is not None else sys.argv[1:]))
    res: dict[str, Any] = {"header": header}
    failed = False

    def run(name: str, fn: Callable[[], Any]) -> None:
        """One section; an exception is recorded (and the others still run), results are saved after each."""
        nonlocal failed
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 — a failed section is a result; the exit status says so
            import traceback

            traceback.print_exc()
            res[name + "_error"] = f"{type(e).__name__}: {e}"
            failed = True
        _free()
        with open(os.path.join(out_dir, "serve_bench.json"), "w") as f:
            json.dump(res, f, indent=1)

    if "kdaprobe" in sections:
        run("kdaprobe", lambda: bench_kdaprobe(*probe, device))
    model = None
    if "decode" in sections or "server" in sections:
        model = _model(preset, device, max_seq_len=max(prompt, s_prompt) + max(steps, s_tokens) + 64)
    if "decode" in sections:
        run("decode", lambda: bench_decode(model, batches, prompt, steps, eager_steps, device))
    if "prefill" in sections:
        run("prefill", lambda: bench_prefill(preset, lengths, eager_lengths, device, args.prefill_chunk))
    if "server" in sections:
        run("server", lambda: bench_server(model, clients, s_prompt, s_tokens, max(clients)))
    md = _markdown(header, res)
    errors = [f"- {k[:-6]}: {v}" for k, v in res.items() if k.endswith("_error")]
    if errors:
        md += "\n## Failed sections\n\n" + "\n".join(errors) + "\n"
    with open(os.path.join(out_dir, "serve_bench.md"), "w") as f:
        f.write(md)
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
