"""``python -m k3.bench conv``: the KDA short convolution (depthwise, causal, kernel 4, SiLU) — the fused Triton op
against the fp32 ``F.conv1d`` reference path, in one process.

- ``small`` training shape: batch 8 × 4,096 tokens over the q/k/v width of ``small`` (8 heads × 128 = 1,024
  channels), bf16 — forward (no grad) and forward+backward (gradients of x and the fp32 weight), the activation
  memory kept for the backward (allocated after the forward, less the output), the step's share (× 3 convs × 9 KDA
  layers).
- K3 prefill shape: one 8,192-token piece with a tail over 96 × 128 = 12,288 channels, bf16, forward only.

Times are medians, two each: the op as called from Python (``triton.testing.do_bench``: launches and autograd
included, what an eager caller pays) and its replay from a CUDA graph (``triton.testing.do_bench_cudagraph``: the
device's time alone, what the training step — one graph — pays). Errors are relative RMS against the fp32 reference
on the same bf16 inputs. ``conv.json`` and ``conv.md`` under ``--out`` are rewritten after every row.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from k3.bench import BenchParser, rel_error, run_line
from k3.config import K3Config
from k3.ops.conv import short_conv, short_conv_reference
from k3.utils import atomic_write_text

W = 4
DEV = "cuda"
IMPLS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "k3 short_conv (Triton, bf16 in place)": short_conv,
    "fp32 F.conv1d reference": short_conv_reference,
}


def _bench(fn: Callable[[], Any]) -> tuple[float, float]:
    """(ms as called, ms replayed from a CUDA graph)."""
    return (float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")),
            float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")))


def _saved_gib(fn: Callable[[], torch.Tensor]) -> float:
    """GiB still allocated after a forward with autograd (what the backward keeps), less the output itself."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    del y
    return kept / 2**30


def bench_training(B: int, T: int, C: int, n_convs: int, emit: Callable[[str, dict], None]) -> None:
    x = torch.randn(B, T, C, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(C, 1, W, device=DEV) * 0.5).requires_grad_()
    dy = torch.randn(B, T, C, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = short_conv_reference(x, w)[0]
    g_ref = torch.autograd.grad(short_conv_reference(x, w)[0], [x, w], dy)
    byts = 2 * B * T * C * 2  # x read, y written once (bf16)
    for name, f in IMPLS.items():
        with torch.no_grad():
            err = rel_error(f(x, w)[0], y_ref)
            t_f, g_f = _bench(lambda f=f: f(x, w))
        got = torch.autograd.grad(f(x, w)[0], [x, w], dy)
        gerr = max(rel_error(a, b) for a, b in zip(got, g_ref))
        del got
        t_fb, g_fb = _bench(lambda f=f: torch.autograd.grad(f(x, w)[0], [x, w], dy))
        saved = _saved_gib(lambda f=f: f(x, w)[0])
        row = dict(name=name, B=B, T=T, C=C, fwd_ms=t_f, fwd_graph_ms=g_f, fwd_tbps=byts / g_f / 1e9, fwd_bwd_ms=t_fb,
                   fwd_bwd_graph_ms=g_fb, step_ms=n_convs * g_fb, saved_gib=saved, rel_err=err, grad_rel_err=gerr)
        emit("training", row)
        print(f"conv training {B}x{T}x{C} | {name:38s} | fwd {t_f:7.3f} / {g_f:7.3f} ms ({byts / g_f / 1e9:4.2f} TB/s) "
              f"| fwd+bwd {t_fb:7.3f} / {g_fb:7.3f} ms | x{n_convs} {n_convs * g_fb:6.2f} ms | saved {saved:5.3f} GiB "
              f"| rel err {err:.1e}, grads {gerr:.1e}", flush=True)


def bench_prefill(T: int, C: int, emit: Callable[[str, dict], None]) -> None:
    x = torch.randn(1, T, C, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(C, 1, W, device=DEV) * 0.5
    tail = torch.randn(1, W - 1, C, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = short_conv_reference(x, w, tail)[0]
        byts = 2 * T * C * 2
        for name, f in IMPLS.items():
            err = rel_error(f(x, w, tail)[0], y_ref)
            t_f, g_f = _bench(lambda f=f: f(x, w, tail))
            emit("prefill", dict(name=name, T=T, C=C, fwd_ms=t_f, fwd_graph_ms=g_f, fwd_tbps=byts / g_f / 1e9,
                                 rel_err=err))
            print(f"conv prefill {T}x{C} | {name:38s} | fwd {t_f:7.3f} / {g_f:7.3f} ms ({byts / g_f / 1e9:4.2f} TB/s) "
                  f"| rel err {err:.1e}", flush=True)


def _markdown(res: dict) -> str:
    L = [f"# KDA short convolution — {res['gpu']}", "",
         run_line(res), "",
         "Depthwise causal conv, kernel 4, SiLU, bf16 activations, fp32 weight. Errors: relative RMS against the fp32 "
         "reference (output; largest over the x and weight gradients). Saved: activation memory the forward keeps "
         "for the backward beyond its output. Times: as called from Python / replayed from a CUDA graph (the "
         "device alone: what the training step, one graph, pays); TB/s and the per-step share from the replay.", "",
         f"## Training, `small` shape (× {res['n_convs']} convs per step)", "",
         "| B × T × C | implementation | forward | forward+backward | per step | saved | rel. err | grad rel. err |",
         "|---|---|---|---|---|---|---|---|"]
    for r in res["training"]:
        L.append(f"| {r['B']} × {r['T']} × {r['C']} | {r['name']} | {r['fwd_ms']:.3f} / {r['fwd_graph_ms']:.3f} ms "
                 f"({r['fwd_tbps']:.2f} TB/s) | {r['fwd_bwd_ms']:.3f} / {r['fwd_bwd_graph_ms']:.3f} ms | "
                 f"{r['step_ms']:.2f} ms | {r['saved_gib']:.3f} GiB | {r['rel_err']:.1e} | {r['grad_rel_err']:.1e} |")
    L += ["", "## Prefill piece with a tail, K3 width, forward", "",
          "| T × C | implementation | forward | rel. err |", "|---|---|---|---|"]
    for r in res["prefill"]:
        L.append(f"| {r['T']} × {r['C']} | {r['name']} | {r['fwd_ms']:.3f} / {r['fwd_graph_ms']:.3f} ms "
                 f"({r['fwd_tbps']:.2f} TB/s) | {r['rel_err']:.1e} |")
    return "\n".join(L) + "\n"


def _write(out: Path, res: dict) -> None:
    for name, text in (("conv.json", json.dumps(res, indent=1)), ("conv.md", _markdown(res))):
        atomic_write_text(out / name, text)


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench conv", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/conv", help="folder for conv.json / conv.md")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--prefill-tokens", type=int, default=8192, help="0: leave out the K3-width prefill row")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.seq_len < 1 or args.prefill_tokens < 0:
        print("python -m k3.bench conv: error: --batch-size and --seq-len must be ≥ 1, --prefill-tokens ≥ 0",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("python -m k3.bench conv: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    small, k3 = K3Config.from_preset("small"), K3Config.from_preset("k3")
    n_convs = 3 * len(small.kda_layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict[str, Any] = dict(
        gpu=torch.cuda.get_device_name(), command="python -m k3.bench conv " + " ".join(argv or sys.argv[2:]),
        versions={"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        n_convs=n_convs, training=[], prefill=[])

    def emit(section: str, row: dict) -> None:
        res[section].append(row)
        res["seconds"] = time.time() - t0
        _write(out, res)

    bench_training(args.batch_size, args.seq_len, small.kda_num_heads * small.kda_head_dim, n_convs, emit)
    torch.cuda.empty_cache()
    if args.prefill_tokens:
        bench_prefill(args.prefill_tokens, k3.kda_num_heads * k3.kda_head_dim, emit)
    print(_markdown(res))
    return 0
