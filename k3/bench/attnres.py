"""``python -m k3.bench attnres``: the AttnRes mix, RMSNorm and the fused loss against eager PyTorch and the libraries
(fla's ``fused_attnres``, liger-kernel's RMSNorm and fused linear cross-entropy), all in one process.

- AttnRes: d 7168, 9 sources, 32 K tokens, bf16 — forward (no grad) and forward+backward, ours with and without the
  fused output norm, fla 0.6's ``fused_attnres`` (its default ``checkpoint_level=1``) likewise, eager fp32 PyTorch
  (forward only: its backward holds tens of GB of fp32 activations). Each row also reports the relative RMS error
  of the output and of every gradient against the fp32 eager reference, and whether all of them are finite.
- RMSNorm: 32 K tokens at d 7168 (K3), bf16 — ours, liger (fp32 casting, ``gemma`` mode, which is our numerics),
  eager.
- Fused loss: ``small``'s shape (d 1024, vocab 32 K, 32 K tokens), bf16 — forward+backward and peak memory: ours,
  liger (fp32 weight-grad accumulation), eager logits + fp32 cross entropy.

``--backward``: only the AttnRes backward's two kernels (streamed; a step's rows held in registers, forced with
``K3_ATTNRES_BACKWARD=streamed`` / ``held``) at ``small``'s width, 2–8 sources → ``attnres_backward.json``.

Times are medians of ``triton.testing.do_bench``; forward+backward returns the gradients (``torch.autograd.grad``)
rather than accumulating them into ``.grad``. A library that does not import (or fails) is reported in the notes
and its row skipped. ``kernels.json`` and ``kernels.md`` under ``--out`` are rewritten after every row, so an
interrupted run keeps what it measured.

Before timing, every autotuning candidate of the Triton kernels measured here (ours and fla's) is compiled in
parallel worker processes (``--jobs``): Triton's autotuner compiles its candidates one after another, and caches the
binaries on disk, so the timed process only loads them. fla's candidates are taken at its lowest ``num_stages``:
its kernels have no software-pipelined loop, so the other ``num_stages`` values compile to the same machine code.
The autotuners (ours and fla's alike) time each candidate for 20 ms instead of Triton's default 100.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton

from k3.bench import BenchParser, rel_error, run_line
from k3.ops.attnres import attn_res_fused, fused
from k3.ops.loss import linear_cross_entropy
from k3.ops.norm import fused as norm_fused
from k3.ops.norm import rms_norm, rms_norm_reference
from k3.utils import atomic_write_text

IGNORE = -100
D_K3, N_SOURCES = 7168, 9
EPS = 1e-5


def _bench(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _peak(fn: Callable[[], Any]) -> float:
    """Peak GiB allocated during one call, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


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


# ---------------------------------------------------------------------------------------------------- precompile

def _fla_autotuners() -> list[Any]:
    import fla.ops.attnres.fused as fla_fused

    return [fla_fused.attnres_fwd_kernel, fla_fused.attnres_bwd_kernel_dv, fla_fused.attnres_bwd_kernel_dqdw]


def _lowest_stages(configs: list[triton.Config]) -> list[triton.Config]:
    """One config per meta-parameter set, at its lowest num_stages (same code for loops that are not pipelined)."""
    best: dict[tuple, triton.Config] = {}
    for c in configs:
        key = (tuple(sorted(c.kwargs.items())), c.num_warps)
        if key not in best or c.num_stages < best[key].num_stages:
            best[key] = c
    return list(best.values())


def _candidates(group: str) -> list[tuple[Any, list[triton.Config]]]:
    """(autotuner, the configs it tries at the benchmark's shapes) for the autotuned kernels of ``group`` ("k3" or
    "fla")."""
    if group == "fla":
        return [(k, _lowest_stages(k.configs)) for k in _fla_autotuners()]
    bd = triton.next_power_of_2(D_K3)
    return [(fused.attn_res_fwd_kernel, fused._prune_fwd(fused._FWD_CONFIGS, {}, BD=bd, ROWS=4)),
            (fused.attn_res_bwd_kernel, fused._prune_bwd(fused._BWD_CONFIGS, {}, BD=bd, ROWS=16)),
            (norm_fused.rms_norm_fwd_kernel, norm_fused._pruner(32)(norm_fused._FWD, {}, BD=bd)),
            (norm_fused.rms_norm_bwd_kernel, norm_fused._pruner(16)(norm_fused._BWD, {}, BD=bd))]


def _quick_autotune(kernels: list[Any]) -> None:
    """Time each autotuning candidate for 20 ms rather than Triton's default 100 (ours and fla's alike)."""
    for k in kernels:
        k.__dict__.pop("do_bench", None)  # a cached_property
        k._do_bench = lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _compile_job(group: str, i: int, T: int) -> str:
    """Worker: restrict ``group``'s autotuned kernels to their i-th candidate and run its benchmarked ops once at
    the benchmark's specialisation (token counts are not specialised; rows per program match ``T``)."""
    torch.cuda.init()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for kernel, configs in _candidates(group):
        kernel.configs = [configs[i % len(configs)]]
    t_mix = 32 * n_sm  # ≥ the rows-per-program thresholds: the same binaries as at T tokens
    srcs = [torch.randn(t_mix, D_K3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(N_SOURCES)]
    w, g, ow = (torch.randn(D_K3, device="cuda", requires_grad=True) for _ in range(3))
    failed = []
    for onorm in (None, ow):
        try:
            if group == "fla":
                from fla.ops.attnres import fused_attnres

                torch.autograd.grad(fused_attnres(w, srcs, g, onorm, rms_eps=EPS).sum(), srcs)
            else:
                torch.autograd.grad(attn_res_fused(w, srcs, g, EPS, onorm).sum(), srcs)
        except Exception as e:  # an unusable candidate: the autotuner skips it too
            failed.append(f"{type(e).__name__}")
    if group == "k3":
        x = torch.randn(T, D_K3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.autograd.grad(rms_norm(x, torch.ones(D_K3, device="cuda", dtype=torch.bfloat16), EPS).sum(), x)
    torch.cuda.synchronize()
    return f"{group} {i}: " + (", ".join(failed) if failed else "ok")


def precompile(T: int, jobs: int, with_fla: bool, notes: list[str]) -> None:
    """Compile every autotuning candidate in ``jobs`` worker processes (binaries land in Triton's disk cache)."""
    work = [(group, i) for group in (("k3", "fla") if with_fla else ("k3",))
            for i in range(max(len(c) for _, c in _candidates(group)))]
    t0 = time.time()
    try:
        with ProcessPoolExecutor(min(jobs, len(work)), mp_context=get_context("spawn")) as pool:
            done = list(pool.map(_compile_job, [g for g, _ in work], [i for _, i in work], [T] * len(work)))
        notes.extend(f"precompile {d}" for d in done if not d.endswith("ok"))
    except Exception as e:  # the timed process then compiles what is missing itself
        notes.append(f"precompile failed ({type(e).__name__}: {e})")
    print(f"precompile | {len(work)} candidate sets in {time.time() - t0:.1f} s", flush=True)


# ---------------------------------------------------------------------------------------------------- rows

def _attnres_ref(srcs: list[torch.Tensor], w: torch.Tensor, g: torch.Tensor, ow: torch.Tensor | None
                 ) -> torch.Tensor:
    """Eager fp32 reference of the mix (and of the output norm after it)."""
    vs = torch.stack([s.float() for s in srcs])
    r = vs * torch.rsqrt(vs.pow(2).mean(-1, keepdim=True) + EPS)
    p = torch.softmax((r * (w * g)).sum(-1), 0)
    o = (p[..., None] * vs).sum(0)
    if ow is not None:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * ow
    return o


def bench_attnres(T: int, D: int, N: int, notes: list[str], emit: Callable[[str, dict], None]) -> None:
    dev, bf = "cuda", torch.bfloat16
    srcs = [torch.randn(T, D, device=dev, dtype=bf, requires_grad=True) for _ in range(N)]
    w = (torch.randn(D, device=dev) / D ** 0.5).requires_grad_()
    g = (torch.rand(D, device=dev) + 0.5).requires_grad_()
    ow = (torch.rand(D, device=dev) + 0.5).requires_grad_()
    dy = torch.randn(T, D, device=dev, dtype=bf)

    impls: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {
        "k3 attn_res": (lambda: attn_res_fused(w, srcs, g, EPS), False),
        "k3 attn_res + output norm": (lambda: attn_res_fused(w, srcs, g, EPS, ow), True),
    }
    fla = _lib("fla", notes)
    _quick_autotune([k for k, _ in _candidates("k3")])
    if fla is not None:
        for kernel, configs in _candidates("fla"):  # the candidates precompile() compiled (the others: same code)
            kernel.configs = configs
        _quick_autotune(_fla_autotuners())
        impls["fla fused_attnres"] = (lambda: fla(w, srcs, g, rms_eps=EPS), False)
        impls["fla fused_attnres + output norm"] = (lambda: fla(w, srcs, g, ow, rms_eps=EPS), True)
    refs: dict[bool, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def reference(onorm: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if onorm not in refs:  # fp32 leaves, the gradients of <y, dy>
            leaves = [t.detach().float().requires_grad_() for t in [*srcs, w, g, ow]]
            y = _attnres_ref(leaves[:N], leaves[N], leaves[N + 1], leaves[N + 2] if onorm else None)
            grads = torch.autograd.grad(y, leaves if onorm else leaves[:-1], dy.float())
            refs[onorm] = (y.detach(), [x.detach() for x in grads])
            del y, leaves, grads
            torch.cuda.empty_cache()
        return refs[onorm]

    byts = (N + 1) * T * D * 2
    for name, (f, onorm) in impls.items():
        leaves = [*srcs, w, g] + ([ow] if onorm else [])
        try:
            with torch.no_grad():
                y = f()
            got = torch.autograd.grad(f(), leaves, dy)
            y_ref, g_ref = reference(onorm)
            finite = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(x).all()) for x in got)
            err = rel_error(y, y_ref)
            gerr = max(rel_error(a, b) for a, b in zip(got, g_ref))
            del y, got
            with torch.no_grad():
                t_f = _bench(f)
            t_fb = _bench(lambda f=f, leaves=leaves: torch.autograd.grad(f(), leaves, dy))
        except Exception as e:
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        emit("attnres", dict(name=name, fwd_ms=t_f, fwd_tbps=byts / t_f / 1e9, fwd_bwd_ms=t_fb, rel_err=err,
                             grad_rel_err=gerr, finite=finite))
        print(f"attnres | {name:32s} | fwd {t_f:6.3f} ms ({byts / t_f / 1e9:4.2f} TB/s) | fwd+bwd {t_fb:6.3f} ms "
              f"| rel err {err:.1e}, grads {gerr:.1e}{'' if finite else ' | NOT FINITE'}", flush=True)
    refs.clear()
    with torch.no_grad():  # eager: forward only
        t_f = _bench(lambda: _attnres_ref(srcs, w, g, None).to(bf))
    emit("attnres", dict(name="eager PyTorch (fp32 mix), forward only", fwd_ms=t_f, fwd_tbps=byts / t_f / 1e9,
                         fwd_bwd_ms=None, rel_err=0.0, grad_rel_err=None, finite=True))
    print(f"attnres | {'eager PyTorch (fp32 mix)':32s} | fwd {t_f:6.3f} ms ({byts / t_f / 1e9:4.2f} TB/s)", flush=True)


def bench_backward_kernels(T: int, D: int, dev: str = "cuda") -> list[dict]:
    """The AttnRes backward's two kernels on the same inputs (bf16, 2..8 sources, with and without the output norm):
    the streamed one and the one holding a step's rows in registers (forced by ``K3_ATTNRES_BACKWARD``), with the
    relative RMS difference of their gradients; one row each."""
    bf = torch.bfloat16 if dev == "cuda" else torch.float32  # fp32 for the Triton interpreter
    rows: list[dict] = []
    for onorm in (False, True):
        for n in range(2, 9):
            if not fused.fits_registers(n, D):
                continue
            srcs = [torch.randn(T, D, device=dev, dtype=bf) * (1 + i / 4) for i in range(n)]
            qw = torch.randn(D, device=dev) / D ** 0.5
            ow = torch.rand(D, device=dev) + 0.5 if onorm else None
            _, o_pre, lse, logit, rstd = fused.attn_res_fwd(srcs, qw, ow, EPS, 1.0, False)
            dy = torch.randn(T, D, device=dev, dtype=bf)
            row: dict[str, Any] = dict(N=n, D=D, T=T, output_norm=onorm)
            grads = {}
            for mode in ("streamed", "held"):
                os.environ["K3_ATTNRES_BACKWARD"] = mode
                try:
                    def bwd() -> Any:
                        return fused.attn_res_bwd(dy, srcs, qw, ow, o_pre, lse, logit, rstd, EPS, 1.0, False)

                    got = bwd()
                    grads[mode] = [*got[0], got[1], got[2]] if onorm else [*got[0], got[1]]
                    row[f"{mode}_ms"] = _bench(bwd)
                finally:
                    os.environ.pop("K3_ATTNRES_BACKWARD")
            row["rel_diff"] = max(rel_error(a, b) for a, b in zip(grads["held"], grads["streamed"]))
            rows.append(row)
            print(f"attnres backward | N {n} D {D}{' + output norm' if onorm else ''} | streamed "
                  f"{row['streamed_ms']:.3f} ms | held {row['held_ms']:.3f} ms | rel diff {row['rel_diff']:.1e}",
                  flush=True)
    return rows


def bench_norm(T: int, D: int, notes: list[str], emit: Callable[[str, dict], None]) -> None:
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    impls: dict[str, Callable[[], torch.Tensor]] = {"k3 rms_norm": lambda: rms_norm(x, w, EPS)}
    liger = _lib("liger_norm", notes)
    if liger is not None:  # gemma casting = everything in fp32, cast at the end; offset 0; not in place
        impls["liger RMSNorm (gemma casting)"] = lambda: liger.apply(x, w, EPS, 0.0, "gemma", False)
    impls["eager PyTorch"] = lambda: rms_norm_reference(x, w, EPS)
    with torch.no_grad():
        ref = rms_norm_reference(x, w, EPS).float()
    for name, f in impls.items():
        try:
            with torch.no_grad():
                err = rel_error(f(), ref)
                t_f = _bench(f)
            t_fb = _bench(lambda f=f: torch.autograd.grad(f(), [x, w], dy))
        except Exception as e:
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        byts = 2 * T * D * 2
        emit("rmsnorm", dict(name=name, d=D, tokens=T, fwd_ms=t_f, fwd_tbps=byts / t_f / 1e9, fwd_bwd_ms=t_fb,
                             rel_err=err))
        print(f"rmsnorm d={D:5d} | {name:30s} | fwd {t_f:6.3f} ms ({byts / t_f / 1e9:5.2f} TB/s) | fwd+bwd "
              f"{t_fb:6.3f} ms | rel err {err:.1e}", flush=True)


def bench_loss(N: int, d: int, V: int, notes: list[str], emit: Callable[[str, dict], None]) -> None:
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
        emit("loss", dict(name=name, tokens=N, d=d, vocab=V, fwd_bwd_ms=t_fb, peak_gib=mem, rel_err=err))
        print(f"loss N={N} d={d} V={V} | {name:34s} | fwd+bwd {t_fb:8.3f} ms | peak +{mem:6.2f} GiB | rel err "
              f"{err:.1e}", flush=True)


# ---------------------------------------------------------------------------------------------------- output

def _versions() -> dict[str, str]:
    v = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    for mod in ("fla", "liger_kernel"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            v[mod] = "not importable"
    return v


def _ms(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f} ms"


def _markdown(res: dict) -> str:
    s = res["attnres_shape"]
    L = [f"# AttnRes / RMSNorm / fused loss kernels — {res['gpu']}", "",
         run_line(res), "",
         f"## AttnRes mix: d {s['D']}, {s['N']} sources, {s['T']} tokens, bf16", "",
         "Errors: relative RMS against the fp32 eager reference (output; largest over the gradients).", "",
         "| implementation | forward | forward+backward | rel. err | grad rel. err | finite |",
         "|---|---|---|---|---|---|"]
    for r in res["attnres"]:
        gerr = "—" if r["grad_rel_err"] is None else f"{r['grad_rel_err']:.1e}"
        L.append(f"| {r['name']} | {r['fwd_ms']:.3f} ms ({r['fwd_tbps']:.2f} TB/s) | {_ms(r['fwd_bwd_ms'])} | "
                 f"{r['rel_err']:.1e} | {gerr} | {'yes' if r['finite'] else 'NO'} |")
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
                 f"{r['peak_gib']:.2f} GiB | {r['rel_err']:.1e} |")
    if res["notes"]:
        L += ["", "Notes: " + "; ".join(res["notes"])]
    return "\n".join(L) + "\n"


def _write(out: Path, res: dict) -> None:
    """Rewrite kernels.json / kernels.md atomically (a row at a time: an interrupted run keeps what it measured)."""
    for name, text in (("kernels.json", json.dumps(res, indent=1)), ("kernels.md", _markdown(res))):
        atomic_write_text(out / name, text)


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench attnres", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/kernels", help="folder for kernels.json / kernels.md")
    p.add_argument("--tokens", type=int, default=32768, help="AttnRes / RMSNorm tokens (default 32768)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="worker processes compiling the autotuning candidates first (0: let the autotuner compile)")
    p.add_argument("--skip-loss", action="store_true", help="leave out the fused-loss section")
    p.add_argument("--backward", action="store_true",
                   help="only the backward kernels, streamed against held rows, at small's width (d 1024): "
                        "attnres_backward.json under --out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m k3.bench attnres: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.jobs < 0:
        print("python -m k3.bench attnres: error: --tokens must be ≥ 1 and --jobs ≥ 0", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    head: dict[str, Any] = dict(gpu=torch.cuda.get_device_name(), versions=_versions(),
                                command="python -m k3.bench attnres " + " ".join(argv or sys.argv[2:]))
    if args.backward:
        rows = bench_backward_kernels(args.tokens, 1024)
        atomic_write_text(out / "attnres_backward.json",
                          json.dumps(dict(head, attnres_backward=rows, seconds=time.time() - t0), indent=1) + "\n")
        return 0
    res: dict[str, Any] = dict(head, attnres_shape=dict(D=D_K3, N=N_SOURCES, T=args.tokens), attnres=[], rmsnorm=[],
                               loss=[], notes=notes)

    def emit(section: str, row: dict) -> None:
        res[section].append(row)
        res["notes"] = sorted(set(notes))
        res["seconds"] = time.time() - t0
        _write(out, res)

    if args.jobs:
        precompile(args.tokens, args.jobs, _lib("fla", []) is not None, notes)
    bench_attnres(args.tokens, D_K3, N_SOURCES, notes, emit)
    torch.cuda.empty_cache()
    bench_norm(args.tokens, D_K3, notes, emit)
    torch.cuda.empty_cache()
    if not args.skip_loss:
        bench_loss(32768, 1024, 32768, notes, emit)
    res["notes"] = sorted(set(notes))
    res["seconds"] = time.time() - t0
    _write(out, res)
    print(_markdown(res))
    return 0
