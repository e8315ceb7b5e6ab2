"""``python -m k3.bench mla``: the MLA attention paths on one GPU, ours beside the alternatives in one process.

Sections (``--sections``, in this order by default; on a GPU each runs in its own child process, so that a fault
in one — a CUDA error poisons the whole context — leaves the others' rows intact; every row catches its own
errors and records them):

``prefill``  one ``GatedMLA`` layer at ``small``'s dims, bf16, chunked prefill of 128K and 1M tokens through an
             ``MLACache``: total time, attention TFLOP/s and peak memory beyond weights + cache + input.
``train``    attention at K3's dims (q·k over 128 nope + 64 rope, v 128), 96 heads, B = 1, T = 8,192, bf16, causal:
             forward and forward+backward of ours (``k3.ops.mla.attention``, Triton) vs the fp32 SDPA path the
             layer used before (q, k, v upcast, memory-efficient kernel) and PyTorch SDPA's bf16 backends (flash
             with v padded to 192 and sliced, cuDNN, memory-efficient; FlexAttention with ``--flex``: its
             compilation takes a minute). FLOPs counted as useful work only: forward 2·pairs·H·(Dqk + Dv),
             backward 2·pairs·H·(3·Dqk + 2·Dv), pairs = T(T+1)/2.
``decode``   the absorbed decode kernel (``mla_decode``: split-K + merge, timed in a CUDA graph) at ``small``'s and
             K3's dims, batch 1/64, cache 4K/128K: time, the cache-read bandwidth it reaches (cache bytes / time)
             and that bandwidth over a device copy's (read + write bytes / time) of the same bytes, the autotuned
             config. At batch 1 the layer's former eager path (fp32 einsums over an fp32 copy of the cache) is
             timed beside it.
``forms``    (not run by default) one 4,096-token prefill chunk at the end of a 128K cache at ``small``'s dims,
             expanded (``mla_prefill``) vs absorbed (``mla_decode`` with T·H query rows).

Results: ``mla_bench.json`` and ``mla_bench.md`` in ``--out`` (default ``$OUT/mla``). ``--smoke`` runs every code
path on tiny CPU shapes (interpreter kernels; no timing claims) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3.bench import BenchParser, rel_error
from k3.config import K3Config
from k3.layers.mla import GatedMLA
from k3.utils import atomic_write_text

__all__ = ["main"]

SECTIONS = ("prefill", "train", "decode", "forms")
DEFAULT_SECTIONS = ("prefill", "train", "decode")


# ------------------------------------------------------------------------------------------------------- timing
def _ms(fn: Callable[[], object], graph: bool = False, rep: int = 200) -> float:
    """Median ms: CUDA events (``do_bench``; ``graph`` replays a captured CUDA graph: device time without the
    host's launch overhead), a host clock on CPU."""
    if torch.cuda.is_available():
        import triton

        # do_bench_cudagraph runs fn on a new stream that does not wait for the current one: without this sync
        # it could read inputs (cache lengths included) that the current stream has not written yet
        torch.cuda.synchronize()
        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


class Rows(list):
    """Result rows; each one is printed as it comes and, with ``path``, the whole list rewritten there (so the rows
    of a section survive a fault that kills its process later)."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.path = path

    def add(self, row: dict) -> None:
        self.append(row)
        print(json.dumps(row), flush=True)
        if self.path:

            atomic_write_text(self.path, json.dumps(list(self)))


# -------------------------------------------------------------------------------------------------------- train
def _fp32_sdpa(q, k, v, scale):
    """The layer's former path: upcast, [B, H, T, D], SDPA causal (no flash backend takes fp32)."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale).transpose(1, 2).to(q.dtype)


def _sdpa_backend(backend, pad_v: bool):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v, scale):
        Dv = v.shape[-1]
        vv = F.pad(v, (0, q.shape[-1] - Dv)) if pad_v else v
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2),
                                               is_causal=True, scale=scale)
        return o.transpose(1, 2)[..., :Dv]

    return fn


def _flex(T: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device=device)
    flex = torch.compile(flex_attention)

    def fn(q, k, v, scale):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                    scale=scale).transpose(1, 2)

    return fn


def _tuned(*kernels) -> str:
    """The configs the autotuner picked (empty where a kernel has not been tuned in this process)."""
    return "; ".join(f"{k.fn.__name__}: {k.best_config}" for k in kernels if getattr(k, "best_config", None))


def bench_train(rows: Rows, T: int, H: int, Dqk: int, Dv: int, device: str, flex: bool,
                deadline: float = float("inf")) -> None:
    from k3.ops.mla import attention
    from k3.ops.mla.flash import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_fwd_kernel

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    q = torch.randn(1, T, H, Dqk, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(1, T, H, Dqk, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(1, T, H, Dv, device=device, dtype=dt, requires_grad=True)
    do = torch.randn(1, T, H, Dv, device=device, dtype=dt)
    scale = Dqk**-0.5
    pairs = T * (T + 1) / 2
    f_fwd, f_bwd = 2 * pairs * H * (Dqk + Dv), 2 * pairs * H * (3 * Dqk + 2 * Dv)
    ref_o = _fp32_sdpa(q, k, v, scale)
    ref_g = torch.autograd.grad(ref_o, [q, k, v], do)
    variants: list[tuple[str, Callable]] = [("fp32 SDPA (former path)", _fp32_sdpa),
                                            ("ours (Triton flash)", lambda q, k, v, s: attention(q, k, v, s)[0])]
    if device == "cuda":
        from torch.nn.attention import SDPBackend

        variants += [("SDPA flash bf16, v padded to Dqk", _sdpa_backend(SDPBackend.FLASH_ATTENTION, True)),
                     ("SDPA cuDNN bf16", _sdpa_backend(SDPBackend.CUDNN_ATTENTION, False)),
                     ("SDPA mem-efficient bf16", _sdpa_backend(SDPBackend.EFFICIENT_ATTENTION, False))]
        if flex:
            variants.append(("FlexAttention bf16 (compiled)", _flex(T, device)))
    base = None
    for name, fn in variants:
        row: dict = dict(section="train", variant=name, T=T, H=H, Dqk=Dqk, Dv=Dv, dtype=str(dt))
        if time.monotonic() > deadline:
            row["error"] = "skipped: --budget-s reached"
            rows.add(row)
            continue
        try:
            o = fn(q, k, v, scale)
            g = torch.autograd.grad(o, [q, k, v], do)
            row.update(rel_o=rel_error(o, ref_o), rel_dq=rel_error(g[0], ref_g[0]), rel_dk=rel_error(g[1], ref_g[1]),
                       rel_dv=rel_error(g[2], ref_g[2]))
            del o, g
            with torch.no_grad():
                row["fwd_ms"] = _ms(lambda: fn(q, k, v, scale))
            row["fwd_bwd_ms"] = _ms(lambda: torch.autograd.grad(fn(q, k, v, scale), [q, k, v], do))
            row["fwd_TFLOPs"] = f_fwd / row["fwd_ms"] * 1e-9
            row["fwd_bwd_TFLOPs"] = (f_fwd + f_bwd) / row["fwd_bwd_ms"] * 1e-9
            if name.startswith("fp32"):
                base = row["fwd_bwd_ms"]
            if base is not None:
                row["speedup_fwd_bwd_vs_fp32"] = base / row["fwd_bwd_ms"]
            if name.startswith("ours") and device == "cuda":
                row["config"] = _tuned(attn_fwd_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel)
        except Exception as e:  # an unsupported backend/shape is a result too
            row["error"] = _error(e)
        _free()
        rows.add(row)


# ------------------------------------------------------------------------------------------------------- decode
def _eager_absorbed(q_lat, q_pe, buf, L, scale):
    """The layer's former decode: fp32 copies of the cache, einsums, softmax."""
    c = q_lat.shape[-1]
    c_kv, k_pe = buf[:, :L].float().split([c, buf.shape[-1] - c], dim=-1)
    s = torch.einsum("bthc,blc->bhtl", q_lat.float(), c_kv) + torch.einsum("bthr,blr->bhtl", q_pe.float(), k_pe)
    return torch.einsum("bhtl,blc->bthc", torch.softmax(s * scale, dim=-1), c_kv)


def _decode_row(row: dict, H: int, c: int, r: int, B: int, L: int, device: str) -> None:
    from k3.ops.mla import mla_decode
    from k3.ops.mla.decode import mla_decode_split_kernel

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    buf = torch.randn(B, L, c + r, device=device, dtype=dt)
    q = torch.randn(B, 1, H, c, device=device, dtype=dt) / c**0.25
    qp = torch.randn(B, 1, H, r, device=device, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    scale = (128 + r) ** -0.5
    mla_decode(q, qp, buf, None, lens, scale)  # tune + compile outside the graph
    row["ms"] = _ms(lambda: mla_decode(q, qp, buf, None, lens, scale), graph=True)
    if device == "cuda":
        row["config"] = _tuned(mla_decode_split_kernel)
    nbytes = buf.numel() * buf.element_size()
    row["cache_GBps"] = nbytes / row["ms"] * 1e-6
    dst = torch.empty_like(buf)
    row["copy_ms"] = _ms(lambda: dst.copy_(buf), graph=True)
    row["copy_GBps"] = 2 * nbytes / row["copy_ms"] * 1e-6  # read + write
    row["of_copy_bw"] = row["cache_GBps"] / row["copy_GBps"]
    del dst
    if B == 1:
        row["eager_fp32_ms"] = _ms(lambda: _eager_absorbed(q, qp, buf, L, scale))


def bench_decode(rows: Rows, dims: dict[str, tuple[int, int, int]], batches: list[int], lengths: list[int],
                 device: str, deadline: float = float("inf")) -> None:
    for name, (H, c, r) in dims.items():
        for B in batches:
            for L in lengths:
                row: dict = dict(section="decode", dims=name, H=H, c=c, r=r, B=B, L=L)
                try:
                    if time.monotonic() > deadline:
                        raise TimeoutError("skipped: --budget-s reached")
                    _decode_row(row, H, c, r, B, L, device)
                except Exception as e:
                    row["error"] = _error(e)
                _free()
                rows.add(row)


# ------------------------------------------------------------------------------------------------------ prefill
def _prefill_row(row: dict, layer, hidden: int, N: int, chunk: int, device: str) -> None:
    dt = next(layer.parameters()).dtype
    cache = layer.init_state(1, dtype=dt, device=device, capacity=N)
    x = torch.randn(1, chunk, hidden, device=device, dtype=dt)
    with torch.no_grad():
        layer(x[:, :256], cache)  # compile/tune on a small piece, then restart the cache
        cache.start.zero_()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device == "cuda" else 0
        t0 = time.perf_counter()
        for s0 in range(0, N, chunk):
            layer(x[:, : min(chunk, N - s0)], cache)
            cache.advance(min(chunk, N - s0))
        if device == "cuda":
            torch.cuda.synchronize()
    row["s"] = time.perf_counter() - t0
    pairs = sum(min(chunk, N - s0) * s0 + min(chunk, N - s0) * (min(chunk, N - s0) + 1) / 2
                for s0 in range(0, N, chunk))
    row["attn_TFLOPs"] = 2 * pairs * row["H"] * (row["Dqk"] + row["Dv"]) / row["s"] * 1e-12
    if device == "cuda":
        row["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    row["cache_GiB"] = cache.buf.numel() * cache.buf.element_size() / 2**30


def bench_prefill(rows: Rows, tokens: list[int], chunk: int, device: str, preset: str = "small",
                  deadline: float = float("inf")) -> None:

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = K3Config.from_preset(preset)
    torch.manual_seed(0)
    layer = GatedMLA(cfg).to(device=device, dtype=dt)
    H, Dqk, Dv = cfg.mla_num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    for N in tokens:
        row: dict = dict(section="prefill", preset=preset, tokens=N, chunk=chunk, H=H, Dqk=Dqk, Dv=Dv)
        try:
            if time.monotonic() > deadline:
                raise TimeoutError("skipped: --budget-s reached")
            _prefill_row(row, layer, cfg.hidden_size, N, chunk, device)
        except Exception as e:
            row["error"] = _error(e)
        _free()
        rows.add(row)


def bench_forms(rows: Rows, L: int, T: int, device: str, H: int = 8, n: int = 64, r: int = 32, v: int = 128,
                c: int = 256) -> None:
    """One piece of T queries at the end of an L-token cache, both forms at ``small``'s dims: expanded (re-expand
    the cache, flash attention per segment) vs absorbed (the decode kernel with T·H query rows)."""
    from k3.ops.mla import mla_decode, mla_prefill

    dt = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    buf = torch.randn(1, L, c + r, device=device, dtype=dt)
    w = (torch.randn(H * (n + v), c, device=device) / c**0.5).to(dt)
    q = torch.randn(1, T, H, n + r, device=device, dtype=dt)
    start = torch.tensor([L - T], dtype=torch.int32, device=device)
    lengths = start + T
    scale = (n + r) ** -0.5
    wv = w.view(H, n + v, c)

    def absorbed():
        q_lat = torch.einsum("bthn,hnc->bthc", q[..., :n], wv[:, :n]).contiguous()
        o_lat = mla_decode(q_lat, q[..., n:].contiguous(), buf, None, lengths, scale)
        return torch.einsum("bthc,hvc->bthv", o_lat, wv[:, n:])

    def expanded():
        return mla_prefill(q, buf, None, start, w, n, v, scale)

    pairs = T * (L - T) + T * (T + 1) / 2
    with torch.no_grad():
        err = rel_error(absorbed(), expanded())
        for name, fn, per_pair in (("expanded (ours)", expanded, n + r + v), ("absorbed", absorbed, 2 * c + r)):
            row: dict = dict(section="forms", form=name, L=L, T=T, H=H, rel_vs_other=err)
            try:
                row["ms"] = _ms(fn)
                row["TFLOPs"] = 2 * pairs * H * per_pair / row["ms"] * 1e-9
            except Exception as e:
                row["error"] = _error(e)
            rows.add(row)
    _free()


# ------------------------------------------------------------------------------------------------------- report
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def markdown(header: dict, rows: list[dict]) -> str:
    parts = [f"# MLA attention benchmark\n\n{header['gpu']}, torch {header['torch']}, triton {header['triton']}, "
             f"{header['date']}.\n\nCommand: `{header['command']}`\n"]
    tables = (("train", "Training attention (K3 dims, B=1, causal, forward + backward)",
               ["variant", "fwd_ms", "fwd_bwd_ms", "fwd_TFLOPs", "fwd_bwd_TFLOPs", "speedup_fwd_bwd_vs_fp32",
                "rel_o", "rel_dq", "error"]),
              ("decode", "Decode step (absorbed, one query per row, CUDA-graph replay)",
               ["dims", "B", "L", "ms", "cache_GBps", "copy_GBps", "of_copy_bw", "eager_fp32_ms", "error"]),
              ("prefill", "Chunked prefill, one MLA layer",
               ["preset", "tokens", "chunk", "s", "attn_TFLOPs", "peak_extra_GiB", "cache_GiB", "error"]),
              ("forms", "One prefill chunk over a cache: expanded vs absorbed form (`small` dims)",
               ["form", "L", "T", "ms", "TFLOPs", "rel_vs_other", "error"]))
    for section, title, cols in tables:
        sel = [r for r in rows if r["section"] == section]
        if sel:
            parts.append(f"## {title}\n\n" + _table(sel, cols))
    return "\n\n".join(parts) + "\n"


def run_section(rows: Rows, s: str, a, device: str, deadline: float) -> None:
    """One section's rows into ``rows`` (full sizes on a GPU, tiny ones with ``--smoke``)."""
    if s == "train":
        if a.smoke:
            bench_train(rows, 64, 2, 24, 16, device, False, deadline)
        else:
            bench_train(rows, 8192, 96, 192, 128, device, a.flex, deadline)
    elif s == "decode":
        if a.smoke:
            bench_decode(rows, {"tiny": (2, 16, 8)}, [1, 2], [40], device, deadline)
        else:
            bench_decode(rows, {"small": (8, 256, 32), "k3": (96, 512, 64)}, [1, 64], [4096, 131072], device,
                         deadline)
    elif s == "prefill":
        if a.smoke:
            bench_prefill(rows, [40], 16, device, "tiny", deadline)
        else:
            bench_prefill(rows, a.prefill_tokens, a.chunk, device, deadline=deadline)
    elif a.smoke:
        bench_forms(rows, 40, 16, device, 2, 8, 8, 16, 16)
    else:
        bench_forms(rows, 131072, 4096, device)


def _child_argv(a, section: str, path: str, budget_s: float | None) -> list[str]:
    argv = ["--sections", section, "--section-rows", path, "--chunk", str(a.chunk), "--prefill-tokens",
            *map(str, a.prefill_tokens)]
    if a.flex:
        argv.append("--flex")
    if a.smoke:
        argv.append("--smoke")
    if budget_s is not None:
        argv += ["--budget-s", f"{budget_s:.1f}"]
    return argv


def run_isolated(sections: list[str], a, deadline: float) -> list[dict]:
    """Each section in a child process (same interpreter and arguments): a CUDA fault ends only its section; the
    rows it wrote before are kept and the fault is recorded as a row."""
    rows: list[dict] = []
    for s in sections:
        left = deadline - time.monotonic()
        if left <= 0:
            rows.append(dict(section=s, error="skipped: --budget-s reached"))
            continue
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.json")
            budget = None if left == float("inf") else left
            cmd = [sys.executable, "-m", "k3.bench", "mla", *_child_argv(a, s, path, budget)]
            rc = subprocess.run(cmd).returncode
            if os.path.exists(path):
                with open(path) as f:
                    rows += json.load(f)
            if rc != 0:
                rows.append(dict(section=s, error=f"section process exited with status {rc} (its log is above)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="python -m k3.bench mla", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for mla_bench.json / .md (default $OUT/mla)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma list of: {', '.join(SECTIONS)}")
    ap.add_argument("--flex", action="store_true", help="time FlexAttention in the train section (compiles ~1 min)")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--chunk", type=int, default=65536, help="prefill chunk length")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes: check the script, no timing claims")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new section or train variant after this many seconds (rows so far are kept)")
    ap.add_argument("--section-rows", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    if not sections or any(s not in SECTIONS for s in sections):
        ap.error(f"--sections must be a comma list of {', '.join(SECTIONS)}, got {a.sections!r}")
    if a.chunk < 1 or min(a.prefill_tokens) < 1:
        ap.error("--chunk and --prefill-tokens must be positive")
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if device == "cpu" and not a.smoke:
        print("k3.bench mla needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if a.smoke:  # before any kernel module is imported: the interpreter is chosen when a kernel is decorated
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("K3_MLA_BACKEND", "triton")
    deadline = time.monotonic() + (a.budget_s if a.budget_s is not None else float("inf"))
    if a.section_rows:  # a child of run_isolated: one section, rows to the given file
        run_section(Rows(a.section_rows), sections[0], a, device, deadline)
        return 0
    import triton

    header = dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)", torch=torch.__version__,
                  triton=triton.__version__, host=platform.node(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python -m k3.bench mla " + " ".join(sys.argv[1:] if argv is None else argv))
    print(json.dumps(header), flush=True)
    if device == "cuda":
        rows = run_isolated(sections, a, deadline)
    else:
        rows = Rows()
        for s in sections:
            run_section(rows, s, a, device, deadline)
    out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "mla")
    os.makedirs(out, exist_ok=True)

    atomic_write_text(os.path.join(out, "mla_bench.json"),
                      json.dumps({"header": header, "rows": list(rows)}, indent=1))
    md = markdown(header, rows)
    atomic_write_text(os.path.join(out, "mla_bench.md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
