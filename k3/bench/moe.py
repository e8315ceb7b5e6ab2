"""``python -m k3.bench moe``: one Latent MoE layer at K3 widths, ours vs plain PyTorch, in one process.

The case: d 7168, ℓ 3584, expert width F 3072, 2 shared experts (width 6144), top-16, one GPU's share at EP=2
(448 experts, 16,384 tokens → 262,144 expert rows), bf16, forward + backward. Printed beside it, from the same run:
the bf16 matmul peak (8192³), a plain-PyTorch layer (``PlainLayer``, the baseline), per-kernel fused-vs-eager
timings, the Quantile Balancing cost (histogram inside the router + bias recovery) as a fraction of the layer, and
its error against the exact sorted quantile.

"ours" is ``k3.layers.moe.LatentMoE`` exactly as the model uses it (training mode, QB histogram recorded), on the
default CUDA backends: fused Triton router epilogue, SiTU-GLU and combine+RMSNorm; experts via ``grouped_mm``.
Section ``small`` (``--only small``): the routed experts' FFN at decode-sized row counts, the fused small-row
kernels (``k3.ops.moe.experts_small_triton``, what inference calls of ≤ ``SMALL_ROWS`` rows run) against three
``grouped_mm`` + SiTU-GLU (what they ran before and training runs), at ``small``'s widths and at one GPU's share of
K3's experts; both eager and replayed from a CUDA graph (as the decode step runs them).

``--smoke`` runs every code path on tiny CPU shapes (no timing claims) to check the script itself.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from k3.bench import BenchParser, rel_error
from k3.config import K3Config
from k3.distributed.expert_parallel import apply_expert_parallel
from k3.layers.moe import LatentMoE
from k3.ops.moe.combine import combine_norm, combine_norm_reference, combine_norm_rows
from k3.ops.moe.experts_small import SMALL_ROWS
from k3.ops.moe.experts_small_triton import grouped_ffn_small
from k3.ops.moe.grouped import (expert_rows, grouped_ffn_gemms, grouped_ffn_packed, grouped_mm, permute_rows,
                                sort_by_expert)
from k3.ops.moe.qb import qb_bias_from_histogram, qb_exact_bias, qb_histogram, qb_range
from k3.ops.moe.router import route, route_reference
from k3.ops.moe.situ import situ_glu_packed
from k3.utils import atomic_write_text

__all__ = ["main", "Shapes", "PlainLayer"]


@dataclass
class Shapes:
    T: int = 16384  # tokens
    d: int = 7168
    l: int = 3584  # latent
    Fw: int = 3072  # expert width
    E: int = 448  # experts on this GPU (EP=2 share of 896)
    k: int = 16
    S: int = 6144  # shared experts' fused width (2 × 3072)

    def flops_fwd(self) -> float:
        """The baseline's count: experts, shared, W↓/W↑, router."""
        T, d, l, Fw, E, k, S = self.T, self.d, self.l, self.Fw, self.E, self.k, self.S
        return 2 * T * k * 3 * Fw * l + 2 * T * 3 * d * S + 2 * T * 2 * d * l + 2 * T * d * E


SMOKE = Shapes(T=24, d=32, l=16, Fw=24, E=8, k=2, S=48)


def _bench(fn: Callable[[], object], rep_ms: float = 1500.0, warmup_ms: float = 300.0) -> float:
    """Median milliseconds (CUDA events via triton's do_bench; a host clock on CPU)."""
    if torch.cuda.is_available():
        import triton

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------------------------------------- baseline
def _situ_eager(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.float(), u.float()
    return (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)).to(torch.bfloat16)


class PlainLayer:
    """The baseline: a plain-PyTorch Latent MoE (fp32 sigmoid router + top-k, argsort
    dispatch, ``grouped_mm`` experts with a packed [E, ℓ, 2F] gate/up, eager SiTU-GLU, index_add combine, RMSNorm,
    W↑, shared experts)."""

    def __init__(self, sh: Shapes, dev: str) -> None:
        dt = torch.bfloat16 if dev == "cuda" else torch.float32

        def w(*s: int) -> torch.Tensor:
            return (torch.randn(*s, device=dev) * 0.02).to(dt).requires_grad_(True)

        self.sh, self.dt = sh, dt
        self.Wr, self.Wd, self.Wu = w(sh.E, sh.d), w(sh.l, sh.d), w(sh.d, sh.l)
        self.W13, self.W2 = w(sh.E, sh.l, 2 * sh.Fw), w(sh.E, sh.Fw, sh.l)
        self.Sg, self.Su, self.Sd = w(sh.S, sh.d), w(sh.S, sh.d), w(sh.d, sh.S)
        self.nw = torch.ones(sh.l, device=dev, requires_grad=True)
        self.bias = torch.zeros(sh.E, device=dev)
        self.gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm

    def _gmm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if a.is_cuda:
            return self.gmm(a, b, offs=offs)
        return grouped_mm(a, b, offs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.sh
        T, k, E = x.shape[0], sh.k, sh.E
        s = torch.sigmoid(x.float() @ self.Wr.float().t())
        idx = torch.topk(s + self.bias, k, dim=-1).indices
        p = s.gather(1, idx)
        p = p / p.sum(-1, keepdim=True)
        z = x @ self.Wd.t()
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        h = self._gmm(z[tok], self.W13, offs)
        a = _situ_eager(*h.chunk(2, -1)).to(self.dt)
        y = self._gmm(a, self.W2, offs) * p.flatten()[order][:, None].to(self.dt)
        u = torch.zeros(T, sh.l, device=x.device, dtype=self.dt).index_add(0, tok, y)
        u = F.rms_norm(u, (sh.l,), self.nw.to(self.dt), 1e-5)
        return u @ self.Wu.t() + (_situ_eager(x @ self.Sg.t(), x @ self.Su.t()).to(self.dt) @ self.Sd.t())


# ---------------------------------------------------------------------------------------------- ours
def build_latent_moe(sh: Shapes, dev: str):
    """``k3.layers.moe.LatentMoE`` at these widths, bf16 weights (fp32 QB bias), baseline-like init, on ``dev``."""
    cfg = K3Config.from_preset("k3", hidden_size=sh.d, n_experts=sh.E, top_k=sh.k, expert_dim=sh.Fw,
                               latent_dim=sh.l, n_shared_experts=sh.S // sh.Fw)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            moe = LatentMoE(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return moe.train()


def _fwd_bwd(f: Callable[[], torch.Tensor], do: torch.Tensor, fresh: list[torch.Tensor] | None = None
             ) -> Callable[[], None]:
    """fwd+bwd; with ``fresh`` the listed tensors' ``.grad`` is set to None first (the optimizer default
    ``zero_grad(set_to_none=True)``: the new gradient is stored, not added into an existing one)."""

    def run() -> None:
        if fresh is not None:
            for t in fresh:
                t.grad = None
        f().backward(do)

    return run


def _layer_rows(name: str, fwd: float, fb: float, fb2: float, fb_none: float, sh: Shapes, peak: float) -> dict:
    fl = sh.flops_fwd()
    return {"name": name, "fwd_ms": fwd, "fwd_bwd_ms": fb, "fwd_bwd_ms_repeat": fb2, "fwd_bwd_fresh_ms": fb_none,
            "fwd_tflops": fl / fwd / 1e9, "fwd_bwd_tflops": 3 * fl / fb / 1e9,
            "frac_peak": 3 * fl / fb / 1e9 / peak if peak else float("nan"),
            "frac_peak_fresh": 3 * fl / fb_none / 1e9 / peak if peak else float("nan")}


def _time_layer(name: str, f: Callable[[], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
                do: torch.Tensor, sh: Shapes, peak: float, rep: float) -> dict:
    with torch.no_grad():
        tf = _bench(f, rep)
    tb = _bench(_fwd_bwd(f, do), rep)  # gradients accumulate into .grad, as the baseline measured
    tb2 = _bench(_fwd_bwd(f, do), rep)  # the same again: the spread between the two is the noise
    tn = _bench(_fwd_bwd(f, do, [x, *params]), rep)
    row = _layer_rows(name, tf, tb, tb2, tn, sh, peak)
    print(row, flush=True)
    return row


def pack_experts(moe) -> None:
    """The layer change this benchmark measures, applied from outside: gate/up packed in one ``w13 [E, 2F, ℓ]``
    GEMM instead of two."""
    ex = moe.experts
    w13 = torch.nn.Parameter(torch.cat([ex.w1.detach(), ex.w3.detach()], 1))
    del ex.w1, ex.w3
    ex.w13 = w13

    def routed(z, idx, p, record=False):
        row_of, tok, offs = expert_rows(idx, ex.n_experts)
        rows = grouped_ffn_packed(permute_rows(z, tok, row_of), offs, ex.w13, ex.w2, ex.beta1, ex.beta2)
        return combine_norm_rows(rows, row_of, p, moe.routed_expert_norm.weight, moe.eps)

    moe.routed = routed


def bench_layers(sh: Shapes, dev: str, peak: float, rep: float) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    x = torch.randn(sh.T, sh.d, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    x.requires_grad_(True)
    plain = PlainLayer(sh, dev)
    with torch.no_grad():
        do = torch.randn_like(plain(x))
    pp = [plain.Wr, plain.Wd, plain.Wu, plain.W13, plain.W2, plain.Sg, plain.Su, plain.Sd, plain.nw]
    rows.append(_time_layer("plain PyTorch (baseline)", lambda: plain(x), x, pp, do, sh, peak, rep))
    del plain, pp
    _free(x)
    moe = build_latent_moe(sh, dev)
    mp = list(moe.parameters())
    rows.append(_time_layer("ours: LatentMoE (training, QB histogram on)", lambda: moe(x), x, mp, do, sh, peak, rep))
    del mp
    moe.zero_grad(set_to_none=True)
    _free(x)
    with torch.no_grad():  # no gradient: nothing is recorded
        y_before = moe(x)
        pack_experts(moe)
        y_after = moe(x)
    same = rel_error(y_after, y_before)
    del y_before, y_after
    mp = list(moe.parameters())
    rows.append(_time_layer("ours + packed w13 (proposed)", lambda: moe(x), x, mp, do, sh, peak, rep))
    rows[-1]["rel_err_vs_unpacked"] = same
    del moe, mp
    _free(x)
    return rows


def _free(*keep: torch.Tensor) -> None:
    for t in keep:
        t.grad = None
    gc.collect()  # layers with a patched ``routed`` hold a reference cycle: free them before the next allocation
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- components
def bench_components(sh: Shapes, dev: str, rep: float) -> list[dict]:
    """fwd+bwd of each fused kernel vs its eager/reference form at the layer's shapes."""
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out = []
    R = sh.T * sh.k

    def pair(name: str, ref: Callable[[], torch.Tensor], fused: Callable[[], torch.Tensor], bytes_min: float) -> None:
        with torch.no_grad():
            r0 = ref()
        g_ref = torch.randn_like(r0.float()).to(r0.dtype)
        del r0
        t_ref = _bench(_fwd_bwd(ref, g_ref), rep / 3)
        t_fused = _bench(_fwd_bwd(fused, g_ref), rep / 3)
        out.append({"name": name, "eager_ms": t_ref, "fused_ms": t_fused, "speedup": t_ref / t_fused,
                    "fused_TBps": bytes_min / t_fused / 1e9})

    x = (torch.randn(sh.T, sh.d, device=dev) * 1.0).to(dt).requires_grad_(True)
    wr = (torch.randn(sh.E, sh.d, device=dev) * 0.02).to(dt).requires_grad_(True)
    bias = torch.randn(sh.E, device=dev) * 0.01
    hist = torch.zeros(sh.E, 1000, dtype=torch.int32, device=dev)
    pair("router fwd+bwd (E=%d, with QB hist)" % sh.E,
         lambda: route_reference(x, wr, bias, sh.k, hist=hist)[1], lambda: route(x, wr, bias, sh.k, hist=hist)[1],
         2 * sh.T * sh.d * 3)
    idx, p = route(x.detach(), wr.detach(), bias, sh.k)
    del x, wr
    h = (torch.randn(R, 2 * sh.Fw, device=dev) * 3).to(dt).requires_grad_(True)
    pair("SiTU-GLU fwd+bwd [T·k, 2F]", lambda: _situ_eager(*h.chunk(2, -1)).to(dt), lambda: situ_glu_packed(h),
         h.numel() * h.element_size() * 4)
    del h
    order, tok, _ = sort_by_expert(idx, sh.E)
    y = torch.randn(R, sh.l, device=dev).to(dt).requires_grad_(True)
    pw = torch.ones(sh.l, device=dev, requires_grad=True)
    pr = p.clone().requires_grad_(True)
    pair("combine + RMSNorm fwd+bwd", lambda: combine_norm_reference(y, order, pr, pw, 1e-5),
         lambda: combine_norm(y, order, pr, pw, 1e-5), y.numel() * y.element_size() * 3)
    del y
    z = torch.randn(sh.T, sh.l, device=dev).to(dt).requires_grad_(True)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)
    pair("token → expert-row permute fwd+bwd", lambda: z[tok], lambda: permute_rows(z, tok, row_of.view(-1, sh.k)),
         R * sh.l * z.element_size() * 3)
    del z
    _free()
    return out


def bench_gemm_layouts(sh: Shapes, dev: str, rep: float) -> list[dict]:
    """Expert GEMMs fwd+bwd: gate/up as two GEMMs (w1, w3 [E, F, ℓ], transposed views) vs one packed GEMM."""

    if dev != "cuda":
        return []
    dt = torch.bfloat16
    R = sh.T * sh.k
    idx = torch.stack([torch.randperm(sh.E, device=dev)[: sh.k] for _ in range(64)]).repeat(sh.T // 64, 1)
    _, _, offs = sort_by_expert(idx, sh.E)
    xs = torch.randn(R, sh.l, device=dev, dtype=dt).requires_grad_(True)
    res = []

    def one(name: str, f: Callable[[], torch.Tensor], flops: float) -> None:
        with torch.no_grad():
            g = torch.randn_like(f())
        t = _bench(_fwd_bwd(f, g), rep / 3)
        res.append({"name": name, "fwd_bwd_ms": t, "tflops": 3 * flops / t / 1e9})

    w1 = (torch.randn(sh.E, sh.Fw, sh.l, device=dev) * 0.02).to(dt).requires_grad_(True)
    w3 = (torch.randn(sh.E, sh.Fw, sh.l, device=dev) * 0.02).to(dt).requires_grad_(True)
    fl_gu = 2 * R * sh.l * 2 * sh.Fw
    one("gate+up: 2 GEMMs, w1/w3 [E,F,ℓ] (K-major B)",
        lambda: grouped_mm(xs, w1.transpose(1, 2), offs) + grouped_mm(xs, w3.transpose(1, 2), offs), fl_gu / 1.0)
    del w1, w3
    _free(xs)
    w13 = (torch.randn(sh.E, 2 * sh.Fw, sh.l, device=dev) * 0.02).to(dt).requires_grad_(True)
    one("gate+up: 1 packed GEMM, w13 [E,2F,ℓ] (K-major B)", lambda: grouped_mm(xs, w13.transpose(1, 2), offs), fl_gu)
    del w13
    _free(xs)
    w13r = (torch.randn(sh.E, sh.l, 2 * sh.Fw, device=dev) * 0.02).to(dt).requires_grad_(True)
    one("gate+up: 1 packed GEMM, W13 [E,ℓ,2F] (baseline layout)", lambda: grouped_mm(xs, w13r, offs), fl_gu)
    del w13r
    _free(xs)
    a = torch.randn(R, sh.Fw, device=dev, dtype=dt).requires_grad_(True)
    w2 = (torch.randn(sh.E, sh.l, sh.Fw, device=dev) * 0.02).to(dt).requires_grad_(True)
    one("down: w2 [E,ℓ,F] (K-major B)", lambda: grouped_mm(a, w2.transpose(1, 2), offs), 2 * R * sh.Fw * sh.l)
    del w2
    _free(a)
    return res


# ---------------------------------------------------------------------------------------------- QB
def bench_qb(sh: Shapes, dev: str, layer_ms: float, rep: float) -> list[dict]:

    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    res = []
    for E in sorted({sh.E, 2 * sh.E}):
        x = torch.randn(sh.T, sh.d, device=dev).to(dt)
        w = (torch.randn(E, sh.d, device=dev) * 0.02).to(dt)
        bias = torch.randn(E, device=dev) * 0.01
        hist = torch.zeros(E, 1000, dtype=torch.int32, device=dev)
        with torch.no_grad():
            t_no = _bench(lambda: route(x, w, bias, sh.k), rep / 4)
            t_h = _bench(lambda: route(x, w, bias, sh.k, hist=hist), rep / 4)
            t_b = _bench(lambda: qb_bias_from_histogram(hist, bias, sh.k), rep / 4)
        # accuracy on the baseline's score distribution: histogram bias vs the exact sorted quantile
        s = torch.sigmoid(torch.randn(sh.T, E, device=dev) + torch.linspace(-2, 2, E, device=dev))
        errs = []
        for b0 in (torch.zeros(E, device=dev), torch.randn(E, device=dev) * 0.05):
            h = qb_histogram(s, b0, sh.k, 1000)
            _, span = qb_range(b0)
            err = (qb_bias_from_histogram(h, b0, sh.k) - qb_exact_bias(s, b0, sh.k)).abs().max()
            errs.append(float(err) / (float(span) / 1000))
        t_hs = _bench(lambda: qb_histogram(s, bias, sh.k, 1000), rep / 4)
        t_sort = _bench(lambda: qb_exact_bias(s, bias, sh.k), rep / 4)
        qb_ms = max(t_h - t_no, 0.0) + t_b
        res.append({"E": E, "route_ms": t_no, "route_hist_ms": t_h, "hist_extra_ms": t_h - t_no,
                    "bias_from_hist_ms": t_b, "qb_ms": qb_ms, "qb_frac_layer": qb_ms / layer_ms,
                    "hist_from_scores_ms": t_hs, "exact_sort_fp64_ms": t_sort, "max_err_bins": max(errs)})
        del x, w, s
        _free()
    return res


# ---------------------------------------------------------------------------------------------- small rows
@dataclass
class SmallCase:
    name: str
    E: int
    k: int
    l: int
    Fw: int
    rows: tuple[int, ...]  # R = tokens · k
    layers: int  # weight sets run per timed call (one each), so the weights come from HBM and not from L2


SMALL_CASES = [
    SmallCase("small: E 128, top-8, ℓ 512, F 512, 12 layers", 128, 8, 512, 512, (8, 512, 1024, 2048), 12),
    SmallCase("K3 EP=2 share: E 448, top-16, ℓ 3584, F 3072", 448, 16, 3584, 3072, (16, 512), 1),
]
SMALL_SMOKE = [SmallCase("smoke", 6, 2, 32, 48, (2, 10), 2)]


def _every_layer(ffn: Callable[..., torch.Tensor], x: torch.Tensor, offs: list[torch.Tensor],
                 ws: list[list[torch.Tensor]]) -> Callable[[], None]:
    """One call of ``ffn`` per layer's routing and weights."""
    return lambda: [ffn(x, o, *w) for o, w in zip(offs, ws)]


def _bench_graph(fn: Callable[[], object], rep_ms: float) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (the decode step's launch cost); NaN on CPU."""
    if not torch.cuda.is_available():
        return float("nan")
    import triton

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def bench_small_rows(cases: list[SmallCase], dev: str, rep: float) -> list[dict]:
    """Per case and row count: ms per layer of both expert paths, eager and from a CUDA graph, the active experts'
    weight bytes over the graph time, and the fused output's error against the grouped_mm path."""
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("small: skipped (the Triton kernels need a GPU or TRITON_INTERPRET=1)", flush=True)
        return []
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out = []
    for c in cases:
        g = torch.Generator(device=dev).manual_seed(0)
        shapes = ((c.E, c.Fw, c.l), (c.E, c.Fw, c.l), (c.E, c.l, c.Fw))  # w1, w3, w2
        ws = [[torch.randn(*s, device=dev, dtype=dt, generator=g).mul_(0.02) for s in shapes] for _ in range(c.layers)]
        for R in c.rows:
            m = R // c.k
            idx = [torch.rand(m, c.E, device=dev, generator=g).topk(c.k, dim=-1).indices for _ in range(c.layers)]
            offs = [expert_rows(i, c.E)[2] for i in idx]
            x = torch.randn(m * c.k, c.l, device=dev, generator=g).to(dt)
            active = sum(int((torch.diff(o, prepend=o.new_zeros(1)) > 0).sum()) for o in offs) / c.layers

            with torch.no_grad():
                err = rel_error(grouped_ffn_small(x, offs[0], *ws[0]), grouped_ffn_gemms(x, offs[0], *ws[0]))
                row = {"case": c.name, "rows": R, "tokens": m, "active_experts": active, "rel_err": err}
                for name, ffn in (("gmm", grouped_ffn_gemms), ("fused", grouped_ffn_small)):
                    run = _every_layer(ffn, x, offs, ws)
                    run()  # compile and autotune outside the timing and the capture
                    row[f"{name}_ms"] = _bench(run, rep / 8, rep / 40) / c.layers
                    row[f"{name}_graph_ms"] = _bench_graph(run, rep / 8) / c.layers
            row["fused_graph_TBps"] = active * 3 * c.l * c.Fw * ws[0][0].element_size() / row["fused_graph_ms"] / 1e9
            print(row, flush=True)
            out.append(row)
        del ws
        _free()
    return out


# ---------------------------------------------------------------------------------------------- checks
def check_layer_vs_reference_ops(dev: str) -> dict:
    """The LatentMoE on the fused backends vs the same layer (same weights) on the torch reference ops, bf16."""
    sh = Shapes(T=2048, d=1024, l=512, Fw=384, E=64, k=8, S=768) if dev == "cuda" else SMOKE
    moe = build_latent_moe(sh, dev)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.01)
    x = torch.randn(sh.T, sh.d, device=dev).to(next(moe.parameters()).dtype)
    res = {}
    outs, grads = [], []
    for backend in ("triton" if dev == "cuda" else "torch", "torch"):
        os.environ["K3_MOE_BACKEND"] = backend
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        y.float().pow(2).mean().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in moe.parameters()])
    os.environ.pop("K3_MOE_BACKEND", None)
    res["out_rel"] = rel_error(outs[0], outs[1])
    res["grad_rel_max"] = max(rel_error(a, b) for a, b in zip(grads[0], grads[1]))
    return res


def check_sync_free(dev: str) -> dict:
    """The MoE forward (training: routing + QB histogram) under ``torch.cuda.set_sync_debug_mode("error")``, and the
    host syncs of a 1-rank NCCL expert-parallel forward (by design one: the all-to-all split sizes)."""
    if dev != "cuda":
        return {"layer": "skipped (CPU)", "ep_world1": "skipped (CPU)"}
    import warnings

    import torch.distributed as dist

    res = {}
    sh = Shapes(T=1024, d=512, l=256, Fw=256, E=64, k=8, S=512)
    moe = build_latent_moe(sh, dev)
    x = torch.randn(sh.T, sh.d, device=dev, dtype=torch.bfloat16)
    moe(x)  # warm-up (compilation, allocator)
    try:
        torch.cuda.set_sync_debug_mode("error")
        moe(x)
        res["layer"] = "passed"
    except Exception as e:  # report, do not hide
        res["layer"] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        (ep,) = apply_expert_parallel(moe, dist.group.WORLD)
        moe(x)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            y = moe(x)
            torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        ok = ep.last_stats.rows == sh.T * sh.k and bool(torch.isfinite(y).all())
        res["ep_world1"] = f"{'passed' if ok else 'FAILED: rows/finite'}, {syncs} host sync(s) per forward"
    except Exception as e:
        torch.cuda.set_sync_debug_mode(0)
        res["ep_world1"] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return res


def bench_peak(dev: str) -> float:
    if dev != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = _bench(lambda: a @ b, 1000)
    return 2 * 8192**3 / t / 1e9


# ---------------------------------------------------------------------------------------------- report
def _md(report: dict) -> str:
    L = [f"# Latent MoE layer benchmark ({report['device']})", "",
         f"torch {report['torch']}, triton {report['triton']}, Python {report['python']}; "
         f"shapes {report['shapes']}; bf16 matmul peak (8192³, same run) **{report['peak_tflops']:.0f} TFLOP/s**.", "",
         f"Command: `{report['command']}`"]
    if report["layers"]:
        L += ["", "fwd+bwd: gradients added into existing `.grad` (as the baseline measured; repeated once for the "
              "spread) and with `.grad` set to None first (one micro-batch after `zero_grad(set_to_none=True)`).", "",
              "| layer | fwd ms | fwd+bwd ms (repeat) | TFLOP/s | of peak | fwd+bwd, fresh grads ms | of peak |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["layers"]:
        L.append(f"| {r['name']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} ({r['fwd_bwd_ms_repeat']:.1f}) | "
                 f"{r['fwd_bwd_tflops']:.0f} | {100 * r['frac_peak']:.0f}% | {r['fwd_bwd_fresh_ms']:.1f} | "
                 f"{100 * r['frac_peak_fresh']:.0f}% |")
    if report["layers"]:
        base = report["layers"][0]
        for r in report["layers"][1:]:
            L += ["", f"{r['name']} over the plain layer, fwd+bwd: **{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}×** "
                  f"(fresh grads {base['fwd_bwd_fresh_ms'] / r['fwd_bwd_fresh_ms']:.2f}×)."]
    if report["components"]:
        L += ["", "| kernel (fwd+bwd) | eager/reference ms | fused ms | speed-up | fused ≥ TB/s |",
              "|---|---:|---:|---:|---:|"]
    for r in report["components"]:
        L.append(f"| {r['name']} | {r['eager_ms']:.2f} | {r['fused_ms']:.2f} | {r['speedup']:.1f}× | {r['fused_TBps']:.2f} |")
    if report["gemms"]:
        L += ["", "| expert GEMM (fwd+bwd) | ms | TFLOP/s |", "|---|---:|---:|"]
        for r in report["gemms"]:
            L.append(f"| {r['name']} | {r['fwd_bwd_ms']:.1f} | {r['tflops']:.0f} |")
    if report["qb"]:
        L += ["", "| QB, T=%d | route ms | +hist ms | bias ms | QB / layer | hist from scores ms | exact sort ms | "
              "max error (bins) |" % report["shapes"]["T"], "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["qb"]:
        L.append(f"| E={r['E']} | {r['route_ms']:.3f} | {r['hist_extra_ms']:.3f} | {r['bias_from_hist_ms']:.3f} | "
                 f"{100 * r['qb_frac_layer']:.2f}% | {r['hist_from_scores_ms']:.3f} | {r['exact_sort_fp64_ms']:.2f} | "
                 f"{r['max_err_bins']:.2f} |")
    if report["small"]:
        L += ["", f"Routed experts' FFN per layer at decode-sized rows, bf16: fused small-row kernels (used for "
              f"inference calls of ≤ {SMALL_ROWS} rows) vs grouped_mm + SiTU-GLU; eager and CUDA-graph replay "
              "(do_bench_cudagraph); TB/s = the active experts' weight bytes over the fused graph time.", "",
              "| case | rows (tokens) | active experts | grouped_mm ms | fused ms | graph: grouped_mm ms | "
              "graph: fused ms | graph speed-up | fused TB/s | rel err |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["small"]:
            L.append(f"| {r['case']} | {r['rows']} ({r['tokens']}) | {r['active_experts']:.0f} | {r['gmm_ms']:.4f} | "
                     f"{r['fused_ms']:.4f} | {r['gmm_graph_ms']:.4f} | {r['fused_graph_ms']:.4f} | "
                     f"{r['gmm_graph_ms'] / r['fused_graph_ms']:.2f}× | {r['fused_graph_TBps']:.2f} | "
                     f"{r['rel_err']:.1e} |")
    L += ["", f"Fused vs reference ops inside LatentMoE (bf16, small shapes): {report['check']}",
          f"Sync-free forward (`torch.cuda.set_sync_debug_mode('error')`): {report['sync']}", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser(prog="python -m k3.bench moe", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=448)
    ap.add_argument("--rep-ms", type=float, default=1500.0, help="timing window per layer measurement")
    ap.add_argument("--out", default=None, help="folder for moe_bench.md / .json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU shapes: exercise every path, no timing claims")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: "
                    "peak,layers,components,gemms,qb,small,check,sync")
    ap.add_argument("--only", default="", help="comma list of the sections to run (the others are skipped)")
    a = ap.parse_args(argv)
    sections = {"peak", "layers", "components", "gemms", "qb", "small", "check", "sync"}
    skip, only = set(filter(None, a.skip.split(","))), set(filter(None, a.only.split(",")))
    if (skip | only) - sections:
        ap.error(f"unknown section(s) {sorted((skip | only) - sections)}; known: {sorted(sections)}")
    if only:
        skip |= sections - only
    dev = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    if dev == "cpu" and not a.smoke:
        print("no CUDA device: run with --smoke for a CPU check of the script", file=sys.stderr)
        return 2
    sh = SMOKE if a.smoke else Shapes(T=a.tokens, E=a.experts)
    import triton

    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "CPU (smoke)", "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(), "shapes": asdict(sh),
              "command": "python -m k3.bench moe " + " ".join(argv if argv is not None else sys.argv[1:])}
    report["peak_tflops"] = float("nan") if "peak" in skip else bench_peak(dev)
    print(f"peak {report['peak_tflops']:.0f} TFLOP/s", flush=True)
    report["check"] = {} if "check" in skip else check_layer_vs_reference_ops(dev)
    print("check", report["check"], flush=True)
    report["sync"] = {} if "sync" in skip else check_sync_free(dev)
    print("sync", report["sync"], flush=True)
    report["layers"] = [] if "layers" in skip else bench_layers(sh, dev, report["peak_tflops"], a.rep_ms)
    layer_ms = report["layers"][1]["fwd_bwd_ms"] if report["layers"] else float("nan")
    report["components"] = [] if "components" in skip else bench_components(sh, dev, a.rep_ms)
    report["gemms"] = [] if "gemms" in skip else bench_gemm_layouts(sh, dev, a.rep_ms)
    report["qb"] = [] if "qb" in skip else bench_qb(sh, dev, layer_ms, a.rep_ms)
    report["small"] = [] if "small" in skip else bench_small_rows(SMALL_SMOKE if a.smoke else SMALL_CASES, dev,
                                                                  a.rep_ms)
    md = _md(report)
    print(md, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        atomic_write_text(os.path.join(a.out, "moe_bench.md"), md)
        atomic_write_text(os.path.join(a.out, "moe_bench.json"), json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
