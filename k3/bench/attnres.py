"""``python -m k3.bench attnres``: the AttnRes mix, RMSNorm and the fused loss against eager PyTorch and the libraries
(fla's ``fused_attnres``, liger-kernel's RMSNorm and fused linear cross-entropy), all in one process.

- AttnRes: d 7168, 9 sources, 32 K tokens, bf16 — forward (no grad) and forward+backward, ours with and without the
  fused output norm, fla 0.6's ``fused_attnres`` (its default ``checkpoint_level=1``), eager fp32 PyTorch.
- RMSNorm: 32 K tokens at d 1024 (``small``) and 7168 (K3), bf16 — ours, liger (fp32 casting, ``gemma`` mode, which is
  our numerics), eager.
- Fused loss: ``small`` (d 1024, vocab 32 K, 32 K tokens) and K3 width (d 7168, vocab 160 K, 8 K tokens), bf16 —
  forward+backward and peak memory: ours, liger (fp32 weight-grad accumulation), eager logits + fp32 cross entropy.

Times are medians of ``triton.testing.do_bench``; forward+backward returns the gradients (``torch.autograd.grad``)
rather than accumulating them into ``.grad``. A library that does not import (or fails) is reported in the notes
and its row skipped.
Writes ``kernels.json`` and ``kernels.md`` under ``--out``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton

from k3.bench import BenchParser
from k3.ops.attnres import attn_res_fused
from k3.ops.loss import linear_cross_entropy
from k3.ops.norm import rms_norm, rms_norm_reference

IGNORE = -100


def _bench(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _peak(fn: Callable[[], Any]) -> float:
    """Peak GiB allocated during one call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _lib(name: str, notes: list[str]) -> Any:
    try:
        if name == "fla":
            from fla.ops.attnres import fused_attnres
            return fused_attnres
        if name == "liger_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return LigerRMSNormFunction
        if name == "liger_flce":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
            return LigerFusedLinearCrossEntropyFunction
    except Exception as e:  # a missing or broken library: report it, skip its column
        notes.append(f"{name}: import failed ({type(e).__name__}: {e}); column skipped")
    return None


def bench_attnres(T: int, D: int, N: int, notes: list[str]) -> list[dict]:
    dev, bf = "cuda", torch.bfloat16
    srcs = [torch.randn(T, D, device=dev, dtype=bf, requires_grad=True) for _ in range(N)]
    w = (torch.randn(D, device=dev) / D ** 0.5).requires_grad_()
    g = torch.ones(D, device=dev, requires_grad=True)
    ow = torch.ones(D, device=dev, requires_grad=True)
    dy = torch.randn(T, D, device=dev, dtype=bf)

    def eager() -> torch.Tensor:
        vs = torch.stack([s.float() for s in srcs])
        r = vs * torch.rsqrt(vs.pow(2).mean(-1, keepdim=True) + 1e-5)
        p = torch.softmax((r * (w * g)).sum(-1), 0)
        return (p[..., None] * vs).sum(0).to(bf)

    impls: dict[str, Callable[[], torch.Tensor]] = {
        "k3 attn_res": lambda: attn_res_fused(w, srcs, g, 1e-5),
        "k3 attn_res + output norm": lambda: attn_res_fused(w, srcs, g, 1e-5, ow),
        "k3 attn_res (save_pre)": lambda: attn_res_fused(w, srcs, g, 1e-5, None, 1.0, True),
    }
    fla = _lib("fla", notes)
    if fla is not None:
        impls["fla fused_attnres"] = lambda: fla(w, srcs, g, rms_eps=1e-5)
        impls["fla fused_attnres + output norm"] = lambda: fla(w, srcs, g, ow, rms_eps=1e-5)
    impls["eager PyTorch (fp32 mix)"] = eager
    with torch.no_grad():
        ref = eager().float()
    rows = []
    byts = (N + 1) * T * D * 2
    leaves = [*srcs, w, g]
    for name, f in impls.items():
        try:
            with torch.no_grad():
                out = f()
                err = _rel(out, ref) if "norm" not in name else float("nan")
                t_f = _bench(f)
            # gradients returned, not accumulated into .grad (no extra add kernels in any column)
            t_fb = _bench(lambda f=f: torch.autograd.grad(f(), leaves, dy))
        except Exception as e:
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        rows.append(dict(name=name, fwd_ms=t_f, fwd_tbps=byts / t_f / 1e9, fwd_bwd_ms=t_fb, rel_err_vs_eager=err))
        print(f"attnres | {name:34s} | fwd {t_f:7.3f} ms ({byts / t_f / 1e9:5.2f} TB/s) | fwd+bwd {t_fb:8.3f} ms "
              f"| rel err {err:.1e}", flush=True)
    return rows


def bench_norm(T: int, D: int, notes: list[str]) -> list[dict]:
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    impls: dict[str, Callable[[], torch.Tensor]] = {"k3 rms_norm": lambda: rms_norm(x, w, 1e-5)}
    liger = _lib("liger_norm", notes)
    if liger is not None:  # gemma casting = everything in fp32, cast at the end; offset 0; not in place
        impls["liger RMSNorm (gemma casting)"] = lambda: liger.apply(x, w, 1e-5, 0.0, "gemma", False)
    impls["eager PyTorch"] = lambda: rms_norm_reference(x, w, 1e-5)
    with torch.no_grad():
        ref = rms_norm_reference(x, w, 1e-5).float()
    rows = []
    for name, f in impls.items():
        try:
            with torch.no_grad():
                err = _rel(f(), ref)
                t_f = _bench(f)
            t_fb = _bench(lambda f=f: torch.autograd.grad(f(), [x, w], dy))
        except Exception as e:
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        byts = 2 * T * D * 2
        rows.append(dict(name=name, d=D, tokens=T, fwd_ms=t_f, fwd_tbps=byts / t_f / 1e9, fwd_bwd_ms=t_fb,
                         rel_err_vs_eager=err))
        print(f"rmsnorm d={D:5d} | {name:30s} | fwd {t_f:6.3f} ms ({byts / t_f / 1e9:5.2f} TB/s) | fwd+bwd "
              f"{t_fb:6.3f} ms | rel err {err:.1e}", flush=True)
    return rows


def bench_loss(N: int, d: int, V: int, notes: list[str]) -> list[dict]:
    h = torch.randn(N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::7] = IGNORE

    def eager() -> torch.Tensor:
        logits = F.linear(h, W).float()
        return F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="sum") / (t != IGNORE).sum().clamp(min=1)

    impls: dict[str, Callable[[], torch.Tensor]] = {"k3 linear_cross_entropy": lambda: linear_cross_entropy(h, W, t)}
    liger = _lib("liger_flce", notes)
    if liger is not None:  # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction, softcap, return_z_loss, accum_dtype)
        impls["liger fused linear CE (fp32 accum)"] = lambda: liger.apply(
            h, W, t, None, None, IGNORE, 0.0, 0.0, "mean", None, False, torch.float32)[0]
    impls["eager logits + fp32 CE"] = eager
    with torch.no_grad():
        ref = eager().item()
    rows = []
    for name, f in impls.items():
        def fb(f: Callable[[], torch.Tensor] = f) -> None:
            torch.autograd.grad(f(), [h, W])

        try:
            err = abs(f().item() - ref) / abs(ref)
            t_fb = _bench(fb)
            mem = _peak(fb)
        except Exception as e:
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        rows.append(dict(name=name, tokens=N, d=d, vocab=V, fwd_bwd_ms=t_fb, peak_gib=mem, rel_err_vs_eager=err))
        print(f"loss N={N} d={d} V={V} | {name:34s} | fwd+bwd {t_fb:8.3f} ms | peak +{mem:6.2f} GiB | rel err "
              f"{err:.1e}", flush=True)
    return rows


def _versions() -> dict[str, str]:
    v = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    for mod in ("fla", "liger_kernel"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            v[mod] = "not importable"
    return v


def _markdown(res: dict) -> str:
    L = [f"# AttnRes / RMSNorm / fused loss kernels — {res['gpu']}", "",
         f"`{res['command']}` · " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()), "",
         f"## AttnRes mix: d {res['attnres_shape']['D']}, {res['attnres_shape']['N']} sources, "
         f"{res['attnres_shape']['T']} tokens, bf16", "",
         "| implementation | forward | forward+backward | rel. err vs eager |", "|---|---|---|---|"]
    for r in res["attnres"]:
        L.append(f"| {r['name']} | {r['fwd_ms']:.3f} ms ({r['fwd_tbps']:.2f} TB/s) | {r['fwd_bwd_ms']:.3f} ms | "
                 f"{r['rel_err_vs_eager']:.1e} |")
    L += ["", "## RMSNorm, bf16", "", "| d | tokens | implementation | forward | forward+backward |",
          "|---|---|---|---|---|"]
    for r in res["rmsnorm"]:
        L.append(f"| {r['d']} | {r['tokens']} | {r['name']} | {r['fwd_ms']:.3f} ms ({r['fwd_tbps']:.2f} TB/s) | "
                 f"{r['fwd_bwd_ms']:.3f} ms |")
    L += ["", "## Linear + cross-entropy, bf16, forward+backward", "",
          "| tokens | d | vocab | implementation | time | peak extra memory | rel. err |",
          "|---|---|---|---|---|---|---|"]
    for r in res["loss"]:
        L.append(f"| {r['tokens']} | {r['d']} | {r['vocab']} | {r['name']} | {r['fwd_bwd_ms']:.2f} ms | "
                 f"{r['peak_gib']:.2f} GiB | {r['rel_err_vs_eager']:.1e} |")
    if res["notes"]:
        L += ["", "Notes: " + "; ".join(res["notes"])]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench attnres", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/kernels", help="folder for kernels.json / kernels.md")
    p.add_argument("--tokens", type=int, default=32768, help="AttnRes / RMSNorm tokens (default 32768)")
    p.add_argument("--skip-loss", action="store_true", help="leave out the fused-loss section")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m k3.bench attnres: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    notes: list[str] = []
    t0 = time.time()
    res: dict[str, Any] = dict(gpu=torch.cuda.get_device_name(), versions=_versions(),
                               command="python -m k3.bench attnres " + " ".join(argv or sys.argv[2:]),
                               attnres_shape=dict(D=7168, N=9, T=args.tokens))
    res["attnres"] = bench_attnres(args.tokens, 7168, 9, notes)
    torch.cuda.empty_cache()
    res["rmsnorm"] = [r for D in (1024, 7168) for r in bench_norm(args.tokens, D, notes)]
    torch.cuda.empty_cache()
    if args.skip_loss:
        res["loss"] = []
    else:
        res["loss"] = bench_loss(32768, 1024, 32768, notes) + bench_loss(8192, 7168, 163840, notes)
    res["notes"] = sorted(set(notes))
    res["seconds"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(res, indent=1))
    (out / "kernels.md").write_text(_markdown(res))
    print(_markdown(res))
    return 0
