"""``python -m k3.bench gemv``: the decode-sized linear kernels (``k3.ops.gemv``) against cuBLAS and the unfused
elementwise kernels, in one process.

- every projection shape of ``small``'s inference forward at 1, 2 and 4 rows: ``F.linear`` (cuBLAS) against the
  Triton kernel; then each fused prologue against the two launches it replaces — SiTU-GLU + ``addmm`` (an MLP's
  down projection with the routed output added), ``rms_norm_gate`` + ``F.linear`` (KDA's output stage),
  ``o ⊙ σ(g)`` + ``F.linear`` (MLA's);
- ``small``'s whole decode step at batch 1 and 2 (CUDA graph replay, 4K-token prompt) with the kernels and with
  ``k3.ops.gemv.gemv.MAX_ROWS = 0`` (every product on cuBLAS, the elementwise ops unfused), same weights and state.

Times: medians of ``triton.testing.do_bench_cudagraph`` (each call replayed inside a CUDA graph, as a decode step
runs it); errors: relative RMS against an fp32 product of the same bf16 inputs. ``gemv.json`` / ``gemv.md`` under
``--out``, rewritten after every section.
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

import k3.ops.gemv.gemv as G
from k3.bench import BenchParser, rel_error, run_line
from k3.bench.serve import _device_ms, _ids, _model, _step_fn
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams
from k3.ops.moe.situ import situ_glu
from k3.ops.norm_gate import rms_norm_gate
from k3.utils import atomic_write_text

DEV = "cuda"


def _t(fn: Callable[[], Any]) -> float:
    """Microseconds per call, each call replayed inside a CUDA graph."""
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def bench_products(model, emit: Callable[[str, dict], None]) -> None:
    from k3.ops.gemv.gemv_triton import gemv

    shapes: dict[tuple[int, int], str] = {}
    for name, mod in model.named_modules():
        w = mod.fused.stacked_weight() if getattr(mod, "fused", None) is not None else getattr(mod, "weight", None)
        if isinstance(mod, torch.nn.Linear) or getattr(mod, "fused", None) is not None:
            if w is not None and w.dim() == 2 and w.shape[0] >= 8:
                shapes.setdefault(tuple(w.shape), name + (" (fused)" if getattr(mod, "fused", None) else ""))
    for (N, K), name in sorted(shapes.items()):
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5
        for M in (1, 2, 4):
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            row = dict(name=name, N=N, K=K, rows=M, cublas_us=_t(lambda: F.linear(x, w)),
                       k3_us=_t(lambda: gemv(x, w)), rel_err=rel_error(gemv(x, w), ref))
            emit("products", row)
            print(f"gemv {name:50s} {N:6d}x{K:5d} rows {M} | cuBLAS {row['cublas_us']:6.2f} us | k3 "
                  f"{row['k3_us']:6.2f} us | err {row['rel_err']:.1e}", flush=True)


def bench_prologues(model, emit: Callable[[str, dict], None]) -> None:
    from k3.ops.gemv.gemv_triton import gemv

    cfg = model.config
    d, H, D = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    bf = dict(device=DEV, dtype=torch.bfloat16)
    for Fw in (cfg.shared_dim, cfg.dense_intermediate_size):  # the shared experts' and the dense MLP's down proj
        g, u = torch.randn(1, Fw, **bf) * 3, torch.randn(1, Fw, **bf) * 10
        w, add = torch.randn(d, Fw, **bf) * Fw ** -0.5, torch.randn(1, d, **bf)
        ref = situ_glu(g, u, cfg.situ_beta1, cfg.situ_beta2).float() @ w.float().t() + add.float()
        k3 = lambda: gemv(g, w, b=u, situ=(cfg.situ_beta1, cfg.situ_beta2), add=add)  # noqa: E731
        unfused = lambda: torch.addmm(add, situ_glu(g, u, cfg.situ_beta1, cfg.situ_beta2), w.t())  # noqa: E731
        emit("prologues", dict(name=f"SiTU-GLU + down projection + add, F {Fw} → {d}", unfused_us=_t(unfused),
                               k3_us=_t(k3), rel_err=rel_error(k3(), ref)))
    o, gl = torch.randn(1, H, D, **bf), torch.randn(1, H, D, **bf) * 3
    nw = torch.rand(D, device=DEV) + 0.5
    w = torch.randn(d, H * D, **bf) * (H * D) ** -0.5
    ref = rms_norm_gate(o, gl, nw, 1e-6, torch.bfloat16).reshape(1, H * D).float() @ w.float().t()
    k3 = lambda: gemv(o.view(1, H * D), w, b=gl.view(1, H * D), norm=(nw, 1e-6, D))  # noqa: E731
    unfused = lambda: F.linear(rms_norm_gate(o, gl, nw, 1e-6, torch.bfloat16).view(1, H * D), w)  # noqa: E731
    emit("prologues", dict(name=f"RMSNorm × σ(gate) + o_proj, {H}×{D} → {d}", unfused_us=_t(unfused), k3_us=_t(k3),
                           rel_err=rel_error(k3(), ref)))
    Kg = cfg.mla_num_heads * cfg.v_head_dim
    o, gl = torch.randn(1, Kg, **bf), torch.randn(1, Kg, **bf) * 3
    w = torch.randn(d, Kg, **bf) * Kg ** -0.5
    ref = (o * torch.sigmoid(gl)).float() @ w.float().t()
    k3 = lambda: gemv(o, w, b=gl, gate=True)  # noqa: E731
    emit("prologues", dict(name=f"o ⊙ σ(gate) + o_proj, {Kg} → {d}", unfused_us=_t(lambda: F.linear(
        o * torch.sigmoid(gl), w)), k3_us=_t(k3), rel_err=rel_error(k3(), ref)))


def bench_step(model, emit: Callable[[str, dict], None], prompt: int = 4000, steps: int = 300) -> None:
    shipped = G.MAX_ROWS
    for B in (1, 2):
        row: dict[str, Any] = dict(batch=B, prompt=prompt)
        for label, rows in (("k3", shipped), ("unfused", 0)):
            G.MAX_ROWS = rows
            try:
                runner = ModelRunner(model, max_batch=B, capacity=prompt + 2 * steps + 64, cuda_graphs=True)
                for s in range(B):
                    runner.admit(s, SamplingParams(temperature=0.0), seed=s)
                    runner.prefill(s, _ids(prompt, model.config.vocab_size, DEV, seed=s))
                runner.decode(list(range(B))).tokens()  # capture
                lengths = runner.state.lengths.clone()
                step = _step_fn(runner, B)
                best = float("inf")
                for _ in range(3):
                    runner.state.lengths.copy_(lengths)
                    best = min(best, _device_ms(step, steps))
                row[f"{label}_ms"] = best
                del runner, step
                torch.cuda.empty_cache()
            finally:
                G.MAX_ROWS = shipped
        row["tok_s"] = B * 1e3 / row["k3_ms"]
        row["unfused_tok_s"] = B * 1e3 / row["unfused_ms"]
        emit("step", row)
        print(f"decode step batch {B}: k3 {row['k3_ms']:.3f} ms ({row['tok_s']:,.0f} tok/s) | cuBLAS + unfused "
              f"{row['unfused_ms']:.3f} ms ({row['unfused_tok_s']:,.0f} tok/s)", flush=True)


def _markdown(res: dict) -> str:
    L = [f"# Decode-sized linear kernels — {res['gpu']}", "",
         run_line(res), "",
         "Medians of `do_bench_cudagraph` (µs per call inside a CUDA graph); errors: relative RMS against an fp32 "
         "product of the same bf16 inputs.", "",
         "## `small`'s decode step (graph replay, 4K-token prompt)", "",
         "| batch | k3 | cuBLAS + unfused elementwise | × |", "|---|---|---|---|"]
    for r in res["step"]:
        L.append(f"| {r['batch']} | {r['k3_ms']:.3f} ms ({r['tok_s']:,.0f} tok/s) | {r['unfused_ms']:.3f} ms "
                 f"({r['unfused_tok_s']:,.0f} tok/s) | {r['unfused_ms'] / r['k3_ms']:.2f} |")
    L += ["", "## Fused prologues, one row (against the launches they replace)", "",
          "| what | unfused | k3 | rel. err |", "|---|---|---|---|"]
    for r in res["prologues"]:
        L.append(f"| {r['name']} | {r['unfused_us']:.2f} µs | {r['k3_us']:.2f} µs | {r['rel_err']:.1e} |")
    L += ["", "## `small`'s projections", "", "| weight | N × K | rows | cuBLAS | k3 | rel. err |",
          "|---|---|---|---|---|---|"]
    for r in res["products"]:
        L.append(f"| {r['name']} | {r['N']} × {r['K']} | {r['rows']} | {r['cublas_us']:.2f} µs | "
                 f"{r['k3_us']:.2f} µs | {r['rel_err']:.1e} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = BenchParser(prog="python -m k3.bench gemv", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gemv", help="folder for gemv.json / gemv.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m k3.bench gemv: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = dict(
        gpu=torch.cuda.get_device_name(), command="python -m k3.bench " + " ".join(["gemv", *(argv or [])]),
        versions=dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version()),
        date=time.strftime("%Y-%m-%d"), step=[], prologues=[], products=[])

    def emit(section: str, row: dict) -> None:
        res[section].append(row)

    def write() -> None:
        atomic_write_text(out / "gemv.json", json.dumps(res, indent=1))
        atomic_write_text(out / "gemv.md", _markdown(res))

    model = _model("small", DEV)
    model.fuse_projections()
    for section in (bench_step, bench_prologues, bench_products):
        with torch.no_grad():
            section(model, emit)
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
