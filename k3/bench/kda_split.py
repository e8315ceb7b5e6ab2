"""KDA split prefill on one card: automatic and forced splits vs unsplit (vs fla when importable), time and memory.

``python -m k3.bench kda_split`` times, for B=1 and each H in ``--H`` (8 32) and T in ``--T`` (128K 1M), the K3
inference call (bf16, bounded gate fused in the kernel, in-kernel L2 norm and β sigmoid, final state, no grad):

- ``unsplit``  ``K3_KDA_SPLITS=1``: the windowed prep + one serial state pass per sequence;
- ``auto``     the library default: the cost model (``k3.ops.kda.prefix.SplitCostModel``) picks P (1 = no split);
- ``split n``  ``K3_KDA_SPLITS=n`` for n in ``--splits`` (2 4 8 16): one prep per chunk, span pass, fold, one
  segmented state pass;
- ``fla``      fla's ``chunk_kda`` (same arguments), when importable.

Each row: median ms (CUDA events), peak memory beyond the inputs (GiB, includes the output), relative RMS error of
output and final state against unsplit, and the cost model's prediction (the measured unsplit time moved by the
model's difference between that row's path and the unsplit one). ``--check`` first compares forced splits 2, 3, 7
with unsplit on a varlen batch in fp32 and bf16. The summary table is printed last (and written to ``--out`` as
markdown). ``--cpu-smoke`` runs the whole script on CPU with the Triton interpreter at tiny shapes (a wiring check,
no meaningful times).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import torch

from k3.bench import BenchParser
from k3.ops.kda import chunk_kda
from k3.ops.kda.prefix import SplitCostModel, balanced_cut, choose_splits
from k3.utils import atomic_write_text, env_var

__all__ = ["split_rows", "check_rows", "format_rows", "main"]

_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, output_final_state=True)


def _time_ms(fn: Callable[[], Any], warmup: int = 1, iters: int = 3) -> float:
    """Median time of ``fn`` in ms (CUDA events on a GPU, wall clock otherwise)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def _peak_extra_gib(fn: Callable[[], Any]) -> float:
    """Peak device memory of one call beyond what was allocated before it (GiB; NaN on CPU)."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _inputs(T: int, H: int, K: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K), beta=r(1, T, H),
                A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * K, device=device))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _model_ms(unsplit_ms: float, H: int, T: int, K: int, P: int, sm: int) -> float:
    """Cost-model prediction for a row: the measured unsplit time moved by the model's difference between that
    row's path (P segments of one T-token sequence) and the (overlapped) unsplit path."""
    from k3.ops.kda.triton import unsplit_windows  # triton is optional

    m = SplitCostModel(sm_count=sm)
    n = -(-T // 64)
    base = m.unsplit_total_us([n], H, K, K, windows=unsplit_windows([T], H, K, K, torch.bfloat16))
    if P <= 1:
        return unsplit_ms
    return unsplit_ms + (m.prep_us([n], H) + m.predict_us(balanced_cut([n], P), H, K, K) - base) / 1e3


def _fla() -> Callable[..., Any] | None:
    try:
        from fla.ops.kda import chunk_kda  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 — optional, and any import failure means "not available"
        return None
    return chunk_kda


def split_rows(shapes: list[tuple[int, int]], splits: list[int], with_fla: bool = True, iters: int = 3,
               K: int = 128, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows ``{H, T, impl, P, ms, extra_gib, err, state_err, model_ms}`` for B=1 prefill (see the module doc)."""
    from k3.ops.kda.triton import unsplit_windows  # triton is optional

    fla = _fla() if with_fla else None
    sm = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    rows = []
    for H, T in shapes:
        x = _inputs(T, H, K, device, dtype)
        run = lambda: chunk_kda(**x, **_FLAGS)  # noqa: E731
        auto_p = choose_splits(1, H, T, sm, K, K, overlap=unsplit_windows([T], H, K, K, dtype))
        variants = [("unsplit", "1", 1), ("auto", "", auto_p)] + [(f"split {n}", str(n), n) for n in splits]
        ref = None
        unsplit_ms = float("nan")
        with torch.no_grad():
            for impl, env, P in variants:
                with env_var("K3_KDA_SPLITS", env or None):
                    o, s = run()
                    if ref is None:
                        ref = (o, s)
                    err, state_err = _rel(o, ref[0]), _rel(s, ref[1])
                    del o, s
                    ms = _time_ms(run, iters=iters)
                    mem = _peak_extra_gib(run)
                if impl == "unsplit":
                    unsplit_ms = ms
                row = dict(H=H, T=T, impl=impl, P=P, ms=ms, extra_gib=mem, err=err, state_err=state_err,
                           model_ms=_model_ms(unsplit_ms, H, T, K, P, sm))
                rows.append(row)
                log(f"H={H} T={T} {impl:10s} P={P}: {ms:8.2f} ms (model {row['model_ms']:.2f}), "
                    f"+{mem:.2f} GiB, err {err:.1e} / {state_err:.1e}")
            if fla is not None:
                try:
                    o, s = fla(**x, **_FLAGS)
                    err, state_err = _rel(o, ref[0]), _rel(s, ref[1])
                    del o, s
                    ms = _time_ms(lambda: fla(**x, **_FLAGS), iters=iters)
                    mem = _peak_extra_gib(lambda: fla(**x, **_FLAGS))
                    rows.append(dict(H=H, T=T, impl="fla", P=1, ms=ms, extra_gib=mem, err=err, state_err=state_err,
                                     model_ms=float("nan")))
                    log(f"H={H} T={T} fla: {ms:8.2f} ms, +{mem:.2f} GiB, err {err:.1e} / {state_err:.1e}")
                except Exception as e:  # noqa: BLE001 — OOM at 1M / H=32 is likely; any fla failure skips its row
                    log(f"H={H} T={T} fla: failed ({type(e).__name__}: {str(e)[:100]})")
                    if device == "cuda":
                        torch.cuda.empty_cache()
        del x, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def check_rows(splits: tuple[int, ...] = (2, 3, 7), H: int = 8, K: int = 128, lens: list[int] | None = None,
               device: str = "cuda", dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
               ) -> list[dict[str, Any]]:
    """Forced splits against the unsplit path on a varlen batch with initial states (g ≈ −0.01, so states carry
    across segment boundaries): relative RMS of outputs and final states."""
    lens = lens or [100_000, 3, 200_000, 777]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=device)
    rows = []
    for dtype in dtypes:
        x = _inputs(sum(lens), H, K, device, dtype)
        x["dt_bias"] = torch.full_like(x["dt_bias"], -6.5)
        h0 = torch.randn(len(lens), H, K, K, device=device)
        run = lambda: chunk_kda(**x, **_FLAGS, cu_seqlens=cu, initial_state=h0)  # noqa: E731
        with torch.no_grad():
            with env_var("K3_KDA_SPLITS", "1"):
                o_ref, s_ref = run()
            for P in splits:
                with env_var("K3_KDA_SPLITS", str(P)):
                    o, s = run()
                rows.append(dict(dtype=str(dtype).split(".")[-1], P=P, finite=bool(torch.isfinite(o).all()),
                                 err=_rel(o, o_ref), state_err=_rel(s, s_ref)))
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one line per (H, T, impl), speed-up against unsplit."""
    base = {(r["H"], r["T"]): r["ms"] for r in rows if r["impl"] == "unsplit"}
    out = ["| B | H | T | impl | P | ms | vs unsplit | model ms | extra GiB | out err | state err |",
           "|" + "---|" * 11]
    for r in rows:
        sp = base.get((r["H"], r["T"]), float("nan")) / r["ms"]
        out.append(f"| 1 | {r['H']} | {r['T']:,} | {r['impl']} | {r['P']} | {r['ms']:.2f} | {sp:.2f}x | "
                   f"{r['model_ms']:.2f} | {r['extra_gib']:.2f} | {r['err']:.1e} | {r['state_err']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = BenchParser(prog="python -m k3.bench kda_split", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[131072, 1048576], help="sequence lengths (B = 1)")
    ap.add_argument("--H", type=int, nargs="+", default=[8, 32], help="head counts")
    ap.add_argument("--splits", type=int, nargs="*", default=[2, 4, 8, 16], help="forced segment counts")
    ap.add_argument("--no-fla", action="store_true", help="skip fla even when importable")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per row (median)")
    ap.add_argument("--check", action="store_true", help="first compare forced splits 2, 3, 7 with unsplit")
    ap.add_argument("--out", default=None, help="also write the summary table (markdown) here")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU through the Triton interpreter: checks the script end to end")
    a = ap.parse_args(argv)
    K, device, dtype = 128, "cuda", torch.bfloat16
    if a.cpu_smoke:
        if torch.cuda.is_available():
            raise SystemExit("--cpu-smoke is for machines without a GPU")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 set before Python starts")
        os.environ["K3_KDA_BACKEND"] = "triton"
        K, device, dtype = 16, "cpu", torch.float32
        a.T, a.H, a.iters = [300], [2], 1
        a.splits = [s for s in a.splits if s <= 4] or [2]
    elif not torch.cuda.is_available():
        raise SystemExit("kda_split needs a CUDA GPU (or --cpu-smoke)")
    if a.check:
        lens = [200, 3, 130] if a.cpu_smoke else None
        for r in check_rows(K=K, lens=lens, device=device, dtypes=(torch.float32,) if a.cpu_smoke else
                            (torch.float32, torch.bfloat16)):
            print(f"check {r['dtype']} P={r['P']}: out rel err {r['err']:.2e}, state rel err {r['state_err']:.2e},"
                  f" finite={r['finite']}", flush=True)
    rows = split_rows([(h, t) for h in a.H for t in a.T], a.splits, not a.no_fla and not a.cpu_smoke, a.iters,
                      K=K, device=device, dtype=dtype, log=lambda s: print(s, flush=True))
    table = format_rows(rows)
    print(table)
    if a.out:
        atomic_write_text(a.out, table + "\n")


if __name__ == "__main__":
    main()
