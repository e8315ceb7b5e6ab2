"""Split prefill vs unsplit (and fla when importable) for long B=1 KDA prefill on one GPU.

``python -m k3.bench.kda_split [--T 131072 1048576] [--H 8 32]`` prints a table; ``split_rows(...)`` returns the
rows for ``k3.bench.kda`` to merge into its table. Inputs are the K3 setting (bf16, bounded gate fused in the
kernel, in-kernel L2 norm and β sigmoid). Unsplit = ``K3_KDA_SPLITS=1``; split = the automatic SM rule (or
``--splits``). "err" is the relative RMS difference of the split output against the unsplit one.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from k3.utils import env_var


__all__ = ["split_rows", "check_rows", "main"]


def _time_ms(fn: Callable[[], Any], warmup: int = 1, iters: int = 3) -> float:
    """Median CUDA-event time of ``fn`` in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _inputs(T: int, H: int, K: int = 128, device: str = "cuda", seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, K), g=r(1, T, H, K), beta=r(1, T, H),
                A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * K, device=device))


_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, output_final_state=True)


def _peak_extra_gib(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def split_rows(
    shapes: list[tuple[int, int]] | None = None, splits: int | None = None, with_fla: bool = True,
    iters: int = 3,
) -> list[dict[str, Any]]:
    """Rows ``{H, T, P, unsplit_ms, split_ms, fla_ms, speedup, err, split_extra_gib}`` for B=1 prefill."""
    from k3.ops.kda import chunk_kda
    from k3.ops.kda.prefix import choose_splits

    fla = None
    if with_fla:
        try:
            from fla.ops.kda import chunk_kda as fla  # type: ignore[no-redef]
        except ImportError:
            fla = None
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for H, T in shapes or [(8, 131072), (8, 1048576), (32, 131072), (32, 1048576)]:
        x = _inputs(T, H)
        P = splits or choose_splits(1, H, T, sm)
        run = lambda: chunk_kda(**x, **_FLAGS)  # noqa: E731
        with torch.no_grad():
            with env_var("K3_KDA_SPLITS", "1"):
                o_ref, s_ref = run()
                t_un = _time_ms(run, iters=iters)
            with env_var("K3_KDA_SPLITS", str(P)):
                o, s = run()
                t_sp = _time_ms(run, iters=iters)
                mem = _peak_extra_gib(run)
            err = float((o.float() - o_ref.float()).norm() / o_ref.float().norm())
            err_s = float((s - s_ref).norm() / s_ref.norm())
            del o, s, o_ref, s_ref
            t_fla = float("nan")
            if fla is not None:
                t_fla = _time_ms(lambda: fla(**x, **_FLAGS), iters=iters)
        rows.append(dict(H=H, T=T, P=P, unsplit_ms=t_un, split_ms=t_sp, fla_ms=t_fla, speedup=t_un / t_sp,
                         err=err, state_err=err_s, split_extra_gib=mem))
        del x
        torch.cuda.empty_cache()
    return rows


def check_rows(splits: tuple[int, ...] = (2, 3, 7), H: int = 8) -> list[dict[str, Any]]:
    """Forced splits against the unsplit path on a varlen batch (fp32 and bf16): relative RMS of o and states."""
    from k3.ops.kda import chunk_kda

    lens = [100_000, 3, 200_000, 777]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = {n: (t.to(dtype) if t.dtype == torch.bfloat16 else t) for n, t in _inputs(sum(lens), H).items()}
        x["dt_bias"] = torch.full_like(x["dt_bias"], -6.5)  # g ≈ −0.01: states carry across segment boundaries
        h0 = torch.randn(len(lens), H, 128, 128, device="cuda")
        run = lambda: chunk_kda(**x, **_FLAGS, cu_seqlens=cu, initial_state=h0)  # noqa: E731
        with torch.no_grad():
            with env_var("K3_KDA_SPLITS", "1"):
                o_ref, s_ref = run()
            for P in splits:
                with env_var("K3_KDA_SPLITS", str(P)):
                    o, s = run()
                rows.append(dict(dtype=str(dtype).split(".")[-1], P=P, finite=bool(torch.isfinite(o).all()),
                                 err=float((o.float() - o_ref.float()).norm() / o_ref.float().norm()),
                                 state_err=float((s - s_ref).norm() / s_ref.norm())))
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = "| B | H | T | P | unsplit ms | split ms | fla ms | split speedup | out err | state err | split extra GiB |"
    out = [head, "|" + "---|" * 11]
    for r in rows:
        out.append(f"| 1 | {r['H']} | {r['T']:,} | {r['P']} | {r['unsplit_ms']:.2f} | {r['split_ms']:.2f} | "
                   f"{r['fla_ms']:.2f} | {r['speedup']:.2f}x | {r['err']:.1e} | {r['state_err']:.1e} | "
                   f"{r['split_extra_gib']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--H", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--splits", type=int, default=None, help="force P (default: the automatic SM rule)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="first compare forced splits 2, 3, 7 with unsplit")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kda_split needs a CUDA GPU")
    if a.check:
        for r in check_rows():
            print(f"check {r['dtype']} P={r['P']}: out rel err {r['err']:.2e}, state rel err {r['state_err']:.2e},"
                  f" finite={r['finite']}", flush=True)
    rows = split_rows([(h, t) for h in a.H for t in a.T], a.splits, not a.no_fla, a.iters)
    print(format_rows(rows))


if __name__ == "__main__":
    main()
