"""``python -m k3.bench kda``: k3's KDA kernels vs fla's ``chunk_kda`` / ``fused_recurrent_kda`` in one process.

Cases: inference prefill B=1, H=32/8, T=16K/128K/1M (the automatic split, the same with a never-forgetting channel
per head, unsplit, fla); training forward+backward B=8 T=4096 and B=1 T=32768 at H=32; one decode step B=64 H=32
with fp32 states (eager and replayed from a CUDA graph). K3 setting: bf16 q/k/v/g, bounded gate (lower_bound −5)
fused in the kernel with A_log / dt_bias, in-kernel L2 norm and β sigmoid, K = V = 128. Times are
``triton.testing.do_bench`` medians (ms); "extra" is the peak memory allocated during the call minus what was
resident before it (inputs), "beyond out" subtracts the output tensor too. ``--sections breakdown`` lists each
kernel's time (profiler) in the training step and the 1M-token prefill.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Callable

import torch

from k3.bench import BenchParser
from k3.ops.kda import chunk_kda, fused_recurrent_kda
from k3.utils import atomic_write_text, env_var

__all__ = ["main"]

K3_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                safe_gate=True, lower_bound=-5.0)
GIB = 2**30


# ---------------------------------------------------------------------------------------------------- helpers


def _bench(fn: Callable[[], Any], rep_ms: float = 200.0) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(10, int(rep_ms // 10)), rep=rep_ms, return_mode="median"))


def _inputs(B: int, T: int, H: int, D: int = 128, grad: bool = False, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    x = dict(q=mk(B, T, H, D), k=mk(B, T, H, D), v=mk(B, T, H, D), g=mk(B, T, H, D), beta=mk(B, T, H),
             A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(H * D, device="cuda"))
    if grad:
        for n in ("q", "k", "v", "g", "beta"):
            x[n].requires_grad_(True)
    return x


def never_forgetting(x: dict) -> dict:
    """``x`` with dt_bias −20 on channel 0 of every head: its decay per token is ~1e-8 (the benchmark's random gates
    otherwise forget within a few tokens)."""
    H = x["A_log"].numel()
    dt = x["dt_bias"].view(H, -1).clone()
    dt[:, 0] = -20.0
    return dict(x, dt_bias=dt.flatten())


def _ours(x: dict, **kw) -> tuple:
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                     output_final_state=True, **{**K3_FLAGS, **kw})


def _fla_module():
    try:
        import fla.ops.kda as fk  # noqa: PLC0415

        return fk
    except Exception:  # noqa: BLE001 — fla is optional
        return None


def _fla(x: dict) -> tuple:
    fk = _fla_module()
    return fk.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                        output_final_state=True, **K3_FLAGS)


def _timed_inference(fn: Callable[[], Any], rep_ms: float, out_bytes: int) -> dict:
    """ms, peak extra GiB (and beyond the output) of ``fn`` under inference mode."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.inference_mode():
        fn()  # compile / warm
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / GIB
        del r
        ms = _bench(fn, rep_ms)
    return dict(ms=ms, extra_gib=extra, beyond_out_gib=extra - out_bytes / GIB)


_JSONL: list[str] = []  # path of the incremental log, when --out is given


def _row(case: str, impl: str, **kw) -> dict:
    """Print one result row as JSON (and append it to the --out log at once: a run cut short keeps its rows)."""
    r = dict(case=case, impl=impl, **kw)
    line = json.dumps(r)
    print(line, flush=True)
    if _JSONL:
        with open(_JSONL[0], "a") as f:
            f.write(line + "\n")
    return r


# ---------------------------------------------------------------------------------------------------- sections


def prefill_rows(shapes: list[tuple[int, int]], with_fla: bool) -> list[dict]:
    rows = []
    for H, T in shapes:
        x = _inputs(1, T, H)
        out_bytes = T * H * 128 * 2
        rep = 150.0 if T <= 131072 else 600.0
        case = f"prefill B=1 H={H} T={T}"
        r_auto = _timed_inference(lambda: _ours(x), rep, out_bytes)
        rows.append(_row(case, "k3 chunk_kda (auto split)", **r_auto))
        # the same call where one channel per head never forgets: the split's decay bound then never drops a
        # segment's history, so this is its cost on gates that remember
        xm = never_forgetting(x)
        rows.append(_row(case, "k3 chunk_kda (auto split), a never-forgetting channel per head",
                         **_timed_inference(lambda: _ours(xm), rep, out_bytes)))
        del xm
        with env_var("K3_KDA_SPLITS", "1"):
            rows.append(_row(case, "k3 unsplit", **_timed_inference(lambda: _ours(x), rep, out_bytes)))
        if with_fla and _fla_module() is not None:
            try:
                rf = _timed_inference(lambda: _fla(x), rep, out_bytes)
                rows.append(_row(case, "fla 0.6.0 chunk_kda", **rf))
            except torch.OutOfMemoryError as e:
                rows.append(_row(case, "fla 0.6.0 chunk_kda", error=f"OOM: {str(e)[:120]}"))
            torch.cuda.empty_cache()
        del x
        torch.cuda.empty_cache()
    return rows


def train_rows(shapes: list[tuple[int, int, int]], with_fla: bool) -> list[dict]:
    rows = []
    impls = [("k3 chunk_kda", _ours)]
    if with_fla and _fla_module() is not None:
        impls.append(("fla 0.6.0 chunk_kda", _fla))
    for B, T, H in shapes:
        case = f"fwd+bwd B={B} T={T} H={H}"
        for name, f in impls:
            x = _inputs(B, T, H, grad=True)
            do = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)

            def fb(x=x, do=do, f=f):
                o, _ = f(x)
                o.backward(do)

            fb()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fb()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / GIB
            ms = _bench(fb, 300.0)
            with torch.no_grad():
                f(x)
                ms_f = _bench(lambda x=x, f=f: f(x), 200.0)
            rows.append(_row(case, name, ms=ms, fwd_ms=ms_f, extra_gib=extra))
            del x, do
            torch.cuda.empty_cache()
    return rows


def decode_rows(with_fla: bool, B: int = 64, H: int = 32) -> list[dict]:
    x = _inputs(B, 1, H)
    h0 = torch.randn(B, H, 128, 128, device="cuda", dtype=torch.float32)
    pool = torch.randn(2 * B, H, 128, 128, device="cuda", dtype=torch.float32)
    idx = torch.randperm(2 * B, device="cuda")[:B]
    traffic = 2 * h0.numel() * 4
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **K3_FLAGS)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    case = f"decode B={B} H={H} fp32 state"
    rows = []
    impls = [("k3 fused_recurrent_kda", lambda: fused_recurrent_kda(*args, initial_state=h0, output_final_state=True,
                                                                    **kw)),
             ("k3 fused_recurrent_kda (pool, in place)",
              lambda: fused_recurrent_kda(*args, initial_state=pool, ssm_state_indices=idx, **kw))]
    fk = _fla_module() if with_fla else None
    if fk is not None:
        fkw = {n: v for n, v in kw.items() if n != "safe_gate"}
        impls.append(("fla 0.6.0 fused_recurrent_kda",
                      lambda: fk.fused_recurrent_kda(*args, initial_state=h0, output_final_state=True, **fkw)))
    # each step eagerly, then replayed from a CUDA graph: GPU time alone. A step's host cost (argument checks and
    # the launcher: k3 ~0.05 ms, fla ~0.09–0.10 on the H200 machines' CPUs) can exceed its GPU time, and then the
    # eager rows time the launch; serving loops capture decode steps in graphs
    def eager(f: Callable[[], Any]) -> Callable[[], Any]:
        f()  # compile and warm; then f itself is timed
        return f

    with torch.inference_mode():
        for label, prepare in ((case, eager), (case + ", CUDA graph", _cuda_graph)):
            for name, f in impls:
                try:
                    ms = _bench(prepare(f), 200.0)
                    rows.append(_row(label, name, ms=ms, state_TBps=traffic / ms / 1e9))
                except Exception as e:  # noqa: BLE001 — report, keep going
                    rows.append(_row(label, name, error=repr(e)[:200]))
    return rows


def _cuda_graph(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after one run on a side stream, as capture requires); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def warm_clocks(seconds: float = 5.0) -> None:
    """Busy the GPU with matrix products for ``seconds`` so its clocks are up before the first timed section (from
    idle, the first section of a run measured 1.5–1.9× slow on an H200 — fla's decode row too)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    del a


def copy_bandwidth() -> float:
    x = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x), 200.0)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2 * GIB / ms / 1e9


def breakdown_rows() -> list[dict]:
    """Each kernel's time (the profiler, CUDA time per call) in the training step B=8 T=4096 H=32 and in the prefill
    B=1 H=32 T=1M."""
    rows = []
    x = _inputs(8, 4096, 32, grad=True)
    do = torch.randn(8, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    rows += _profile_kernels(lambda: _ours(x)[0].backward(do), "breakdown fwd+bwd B=8 T=4096 H=32")
    del x, do
    torch.cuda.empty_cache()
    x = _inputs(1, 1 << 20, 32)
    with torch.inference_mode():
        rows += _profile_kernels(lambda: _ours(x), "breakdown prefill B=1 H=32 T=1M")
    return rows


def _profile_kernels(fn: Callable[[], Any], case: str, calls: int = 3) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA":
            us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / calls
            if us > 5:
                rows.append(_row(case, ev.key[:60], ms=us / 1e3, launches=ev.count // calls))
    return rows


# ---------------------------------------------------------------------------------------------------- report


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown(rows: list[dict], header: dict) -> str:
    lines = [f"# KDA benchmark ({header['gpu']})", "",
             f"torch {header['torch']}, triton {header['triton']}, fla {header['fla']}, {header['date']}; "
             f"copy bandwidth {header.get('copy_TBps', float('nan')):.2f} TB/s", "",
             f"command: `{header['command']}`", ""]
    ref: dict[str, float] = {}
    for r in rows:
        if r["impl"].startswith("fla") and "ms" in r:
            ref[r["case"]] = r["ms"]
    lines += ["| case | impl | ms | vs fla | fwd ms | extra GiB | beyond out GiB | state TB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r.get("ms")
        ratio = f"{ref[r['case']] / ms:.2f}×" if ms and r["case"] in ref and not r["impl"].startswith("fla") else ""
        cells = [r["case"], r["impl"], _fmt(ms) if ms is not None else r.get("error", ""), ratio,
                 _fmt(r.get("fwd_ms", "")), _fmt(r.get("extra_gib", "")), _fmt(r.get("beyond_out_gib", "")),
                 _fmt(r.get("state_TBps", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="python -m k3.bench kda", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for kda_bench.json / kda_bench.md")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--sections", default="decode,prefill,train",
                    help="comma list, run in this order, of: decode,prefill,train,breakdown")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new section after this many seconds (the rows so far are still written)")
    ap.add_argument("--T", type=int, nargs="+", default=[16384, 131072, 1048576])
    ap.add_argument("--H", type=int, nargs="+", default=[32, 8])
    a = ap.parse_args(argv)
    known = ("decode", "prefill", "train", "breakdown")
    bad = [s for s in a.sections.split(",") if s not in known]
    if bad or min(a.T + a.H) < 1:
        ap.error(f"--sections must be a comma list of {', '.join(known)} and --T/--H positive; got "
                 f"{a.sections!r}, T={a.T}, H={a.H}")
    if not torch.cuda.is_available():
        print("k3.bench kda needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    fk = _fla_module()
    header = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  fla=getattr(__import__("fla"), "__version__", "?") if fk is not None else "not installed",
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=platform.node(), command="python -m k3.bench kda " + " ".join(argv or sys.argv[1:]))
    warm_clocks()
    header["copy_TBps"] = copy_bandwidth()
    print(json.dumps(header), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        _JSONL[:] = [os.path.join(a.out, "kda_bench.jsonl")]
        with open(_JSONL[0], "w") as f:
            f.write(json.dumps(header) + "\n")
    t0 = time.monotonic()
    with_fla = not a.no_fla
    rows: list[dict] = []
    runs = {"decode": lambda: decode_rows(with_fla),
            "train": lambda: train_rows([(8, 4096, 32), (1, 32768, 32)], with_fla),
            "breakdown": breakdown_rows,
            "prefill": lambda: prefill_rows([(h, t) for h in a.H for t in a.T], with_fla)}
    for name in a.sections.split(","):
        if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
            rows.append(_row(name, "section skipped", error=f"time budget of {a.budget_s:.0f} s spent"))
            continue
        try:
            rows += runs[name]()
        except Exception as e:  # noqa: BLE001 — one broken section must not lose the others' numbers
            rows.append(_row(name, "section failed", error=repr(e)[:300]))
        torch.cuda.empty_cache()
    md = markdown(rows, header)
    print(md)
    if a.out:
        atomic_write_text(os.path.join(a.out, "kda_bench.json"), json.dumps(dict(header=header, rows=rows), indent=1))
        atomic_write_text(os.path.join(a.out, "kda_bench.md"), md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
