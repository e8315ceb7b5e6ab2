"""Fused MoE kernels (router epilogue + QB histogram, SiTU-GLU, combine + RMSNorm) against the torch references.

On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) in fp32/fp16 on
tiny shapes; bf16 comparisons at realistic widths run only with a GPU. Kernel outputs are poisoned with NaN
(K3_MOE_POISON=1) so an element a kernel forgets to write fails.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.ops.moe.combine import combine_norm, combine_norm_reference, combine_norm_rows
from k3.ops.moe.grouped import expert_counts, grouped_ffn, grouped_ffn_packed, grouped_mm, sort_by_expert
from k3.ops.moe.qb import qb_bias_from_histogram, qb_exact_bias, qb_histogram, qb_range
from k3.ops.moe.router import route, route_reference
from k3.ops.moe.situ import situ_bound, situ_glu, situ_glu_packed, situ_glu_reference

triton = pytest.importorskip("triton")
from k3.ops.moe.combine_triton import combine_norm_fused  # noqa: E402
from k3.ops.moe.router_triton import qb_histogram_fused, route_fused  # noqa: E402
from k3.ops.moe.situ_triton import situ_glu_fused, situ_glu_fused_packed  # noqa: E402
from tests.ops.moe_ref import DEV, gpu, poison_outputs, rel  # noqa: E402, F401 — poison_outputs: autouse


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def situ_fused(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return situ_glu_fused(g, u, 4.0, 25.0, situ_bound(4.0, 25.0, g.dtype))


def situ_fused_packed(gu: torch.Tensor) -> torch.Tensor:
    return situ_glu_fused_packed(gu, 4.0, 25.0, situ_bound(4.0, 25.0, gu.dtype))


# ---------------------------------------------------------------------------------------------- SiTU-GLU
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", [(1, 5), (63, 100), (2, 3, 33)])
def test_situ_fused_matches_reference(shape, dtype, tol):
    torch.manual_seed(0)
    g = (torch.randn(shape, device=DEV) * 6).to(dtype)  # wide range: both tanh caps engaged
    u = (torch.randn(shape, device=DEV) * 40).to(dtype)
    dy = torch.randn(shape, device=DEV).to(dtype)
    g1, u1, g2, u2 = leaf(g), leaf(u), leaf(g.float()), leaf(u.float())
    y = situ_fused(g1, u1)
    y_ref = situ_glu_reference(g2, u2)
    y.backward(dy)
    y_ref.backward(dy.float())
    assert y.dtype == dtype and y.shape == shape
    assert rel(y, y_ref) < tol
    assert rel(g1.grad, g2.grad) < tol and rel(u1.grad, u2.grad) < tol


def test_situ_packed_and_strided_views():
    torch.manual_seed(1)
    h = torch.randn(37, 2 * 24, device=DEV) * 5
    dy = torch.randn(37, 24, device=DEV)
    h1, h2 = leaf(h), leaf(h)
    y = situ_fused_packed(h1)
    y_ref = situ_glu_reference(*h2.chunk(2, -1))
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel(y, y_ref) < 1e-5 and rel(h1.grad, h2.grad) < 1e-5
    h3 = leaf(h)  # the two halves passed as strided views into one buffer
    y3 = situ_fused(*h3.chunk(2, -1))
    (y3 * dy).sum().backward()
    assert rel(y3, y_ref) < 1e-5 and rel(h3.grad, h2.grad) < 1e-5


def test_situ_extremes_are_bounded_and_finite():
    g = torch.tensor([[-1e4, -30.0, -1e-6, 0.0, 1e-6, 30.0, 1e4, 3.0]], device=DEV)
    u = torch.tensor([[1e4, -1e4, 5.0, 0.0, -5.0, 1e3, -1e3, 25.0]], device=DEV)
    g1, u1, g2, u2 = leaf(g), leaf(u), leaf(g), leaf(u)
    y = situ_fused(g1, u1)
    y_ref = situ_glu_reference(g2, u2)
    y.sum().backward()
    y_ref.sum().backward()
    assert y.abs().max() < 100.0 and y_ref.abs().max() < 100.0  # the open bound (−100, 100), also in fp32
    assert (y - y_ref).abs().max() < 1e-4
    assert torch.isfinite(g1.grad).all() and torch.isfinite(u1.grad).all()
    assert (g1.grad - g2.grad).abs().max() < 1e-5 and (u1.grad - u2.grad).abs().max() < 1e-5


def test_situ_public_dispatch_and_checks():
    g, u = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.allclose(situ_glu(g, u), situ_glu_reference(g, u))
    assert torch.allclose(situ_glu_packed(torch.cat([g, u], -1)), situ_glu_reference(g, u))
    with pytest.raises(ValueError, match="gate and up"):
        situ_glu(g, u[:, :3])
    with pytest.raises(ValueError, match="beta1"):
        situ_glu(g, u, beta1=0.0)
    with pytest.raises(ValueError, match="gu"):
        situ_glu_packed(torch.randn(3, 5))


_SITU_SM90 = r"""
import k3.ops.moe.situ_triton as st
from tests.ops.sm90 import compile_sm90

for fn in (st._situ_fwd_kernel, st._situ_bwd_kernel):
    for bm, bf in ((4, 1024), (8, 512), (128, 32), (2, 1024), (4, 512), (64, 32)):  # forward, backward
        const = {"BM": bm, "BF": bf}
        types = {n: "*bf16" if n.endswith("_ptr") else "fp32" if n in ("beta1", "beta2", "lim") else "i32"
                 for n in fn.arg_names if n not in const}
        assert "st.global" in compile_sm90(fn, types, const, 4).asm["ptx"], (fn.__name__, bm, bf)
print("compiled", flush=True)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check (on a GPU the kernels themselves run)")
def test_situ_kernels_compile_for_sm90_in_bf16():
    """The SiTU-GLU kernels compile to sm_90 code for bf16 tensors without a GPU, at the block shapes ``_blocks``
    picks: what the fp32 interpreter cannot check. In a subprocess: the interpreter is on in this process."""
    from tests.ops.sm90 import run_script

    r = run_script(_SITU_SM90, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- router
def _same_selection(idx, idx_ref, x, w, bias):
    """Sets equal per token, except where the k-th/(k+1)-th biased scores tie to rounding."""
    a, b = idx.sort(-1).values, idx_ref.sort(-1).values
    bad = (a != b).any(-1)
    if bad.any():
        z = torch.sigmoid(x.double() @ w.double().t()) + bias.double()
        top = torch.topk(z[bad], idx.shape[1] + 1, -1).values
        assert (top[:, -2] - top[:, -1]).abs().max() < 1e-5, "selection differs beyond a rounding tie"
    return ~bad


@pytest.mark.parametrize("m,n,k,scaling", [(1, 8, 2, 1.0), (37, 24, 4, 1.0), (50, 40, 6, 2.5)])
def test_route_fused_matches_reference(m, n, k, scaling):
    torch.manual_seed(m)
    x = torch.randn(m, 16, device=DEV)
    w = torch.randn(n, 16, device=DEV) * 0.3
    bias = torch.randn(n, device=DEV) * 0.1
    hist, hist_ref = (torch.zeros(n, 50, dtype=torch.int32, device=DEV) for _ in range(2))
    x1, w1, x2, w2 = leaf(x), leaf(w), leaf(x), leaf(w)
    idx, p = route_fused(x1, w1, bias, k, hist=hist, scaling=scaling, hist_range=qb_range(bias))
    idx_ref, p_ref = route_reference(x2, w2, bias, k, hist=hist_ref, scaling=scaling)
    same = _same_selection(idx, idx_ref, x, w, bias)
    assert idx.dtype == torch.int64 and p.dtype == torch.float32
    assert torch.equal(idx[same], idx_ref[same])  # same order too: descending biased score
    assert rel(p[same], p_ref[same]) < 1e-5
    assert torch.allclose(p.sum(-1), torch.full((m,), scaling, device=DEV), rtol=1e-5)
    assert torch.equal(hist.sum(1), torch.full((n,), m, dtype=torch.int32, device=DEV))
    assert (hist - hist_ref).abs().sum() <= 2 + m * n // 100  # rounding at bin edges only
    assert bool(same.all())  # these seeds have no rounding ties, so the gradients are comparable
    dp = torch.randn(m, k, device=DEV)
    (p * dp).sum().backward()
    (p_ref * dp).sum().backward()
    assert rel(x1.grad, x2.grad) < 1e-5 and rel(w1.grad, w2.grad) < 1e-5


@pytest.mark.parametrize("m", [9, 1])  # one row: logits from the decode-sized kernel on a GPU (k3.ops.gemv)
def test_route_without_hist_and_public_dispatch(m):
    torch.manual_seed(3)
    x, w, bias = torch.randn(m, 8), torch.randn(12, 8), torch.zeros(12)
    idx, p = route_fused(x.to(DEV), w.to(DEV), bias.to(DEV), 3)
    idx_ref, p_ref = route_reference(x, w, bias, 3)
    assert torch.equal(idx.cpu(), idx_ref) and rel(p.cpu(), p_ref) < 1e-6
    idx2, p2 = route(x, w, bias, 3)  # CPU tensors: reference path
    assert torch.equal(idx2, idx_ref) and torch.equal(p2, p_ref)


def test_route_input_checks():
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.zeros(6)
    with pytest.raises(ValueError, match="top_k"):
        route(x, w, b, 6)
    with pytest.raises(ValueError, match="top_k"):
        route(x, w, b, 0)
    with pytest.raises(ValueError, match="weight"):
        route(x, torch.randn(6, 7), b, 2)
    with pytest.raises(ValueError, match="bias"):
        route(x, w, torch.zeros(5), 2)
    with pytest.raises(ValueError, match="hist"):
        route(x, w, b, 2, hist=torch.zeros(6, 10))
    with pytest.raises(ValueError, match="scaling"):
        route(x, w, b, 2, scaling=float("nan"))


def test_qb_histogram_fused_matches_reference_and_exact_quantile():
    torch.manual_seed(5)
    m, n, k, nb = 300, 24, 3, 200
    s = torch.sigmoid(torch.randn(m, n, device=DEV) + torch.linspace(-2, 2, n, device=DEV))
    bias = torch.randn(n, device=DEV) * 0.2
    h = qb_histogram_fused(s, bias, k, torch.zeros(n, nb, dtype=torch.int32, device=DEV), qb_range(bias))
    h_ref = qb_histogram(s.cpu(), bias.cpu(), k, nb).to(DEV)  # CPU tensors: torch reference path
    assert (h - h_ref).abs().sum() <= 2
    b_hist = qb_bias_from_histogram(h, bias, k)
    b_exact = qb_exact_bias(s, bias, k)
    lo, span = qb_range(bias)
    assert (b_hist - b_exact).abs().max() <= span.item() / nb + 1e-6  # within one bin width


# ---------------------------------------------------------------------------------------------- combine
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("m,k,L,E", [(1, 2, 5, 4), (33, 3, 37, 7)])
def test_combine_fused_matches_reference(m, k, L, E, dtype, tol):
    torch.manual_seed(m + L)
    idx = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(m)])
    order, _, _ = sort_by_expert(idx, E)
    y = (torch.randn(m * k, L, device=DEV) * 3).to(dtype)
    p = torch.softmax(torch.randn(m, k, device=DEV), -1)
    w = torch.rand(L, device=DEV) + 0.5
    do = torch.randn(m, L, device=DEV).to(dtype)
    y1, p1, w1 = leaf(y), leaf(p), leaf(w)
    y2, p2, w2 = leaf(y.float()), leaf(p), leaf(w)
    row_of = torch.empty(m * k, dtype=torch.int64, device=DEV)
    row_of[order] = torch.arange(m * k, device=DEV)
    out = combine_norm_fused(y1, row_of.view(m, k), p1, w1, 1e-5)
    ref = combine_norm_reference(y2, order, p2, w2, 1e-5)
    out.backward(do)
    ref.backward(do.float())
    assert out.dtype == dtype
    assert rel(out, ref) < tol
    assert rel(y1.grad, y2.grad) < tol and rel(p1.grad, p2.grad) < tol and rel(w1.grad, w2.grad) < tol


def test_combine_rows_and_checks():
    torch.manual_seed(2)
    m, k, L = 5, 2, 8
    y, p, w = torch.randn(m * k, L), torch.rand(m, k), torch.ones(L)
    ref = combine_norm_reference(y, torch.arange(m * k), p, w, 1e-5)
    assert torch.allclose(combine_norm_rows(y, torch.arange(m * k).view(m, k), p, w, 1e-5), ref, atol=1e-6)
    assert torch.allclose(combine_norm(y, torch.arange(m * k), p, w, 1e-5), ref)
    with pytest.raises(ValueError, match="order"):
        combine_norm(y, torch.arange(m * k - 1), p, w, 1e-5)
    with pytest.raises(ValueError, match="norm_weight"):
        combine_norm(y, torch.arange(m * k), p, torch.ones(L + 1), 1e-5)


# ---------------------------------------------------------------------------------------------- grouped FFN
def test_grouped_ffn_matches_per_token_loop_with_empty_groups():
    torch.manual_seed(4)
    m, k, E, L, F = 11, 2, 6, 8, 12
    idx = torch.stack([torch.randperm(E - 2)[:k] for _ in range(m)])  # experts 4, 5 get no rows
    order, tok, offs = sort_by_expert(idx, E)
    assert torch.equal(expert_counts(idx, E), torch.bincount(idx.flatten(), minlength=E))
    w1, w3, w2 = torch.randn(E, F, L) * 0.3, torch.randn(E, F, L) * 0.3, torch.randn(E, L, F) * 0.3
    z = torch.randn(m, L)
    y = grouped_ffn(z[tok], offs, w1, w3, w2)
    flat = idx.flatten()[order]
    ref = torch.stack([w2[e] @ situ_glu_reference(w1[e] @ z[t], w3[e] @ z[t]) for e, t in zip(flat, tok)])
    assert rel(y, ref) < 1e-5
    y_packed = grouped_ffn_packed(z[tok], offs, torch.cat([w1, w3], 1), w2)
    assert rel(y_packed, ref) < 1e-5
    pad = grouped_ffn(torch.cat([z[tok], torch.randn(3, L)]), offs, w1, w3, w2)  # rows past offs[-1]: no group
    assert pad.shape == (m * k + 3, L) and rel(pad[: m * k], ref) < 1e-5


# ---------------------------------------------------------------------------------------------- GPU, bf16
@gpu
def test_gpu_bf16_kernels_against_references():
    torch.manual_seed(0)
    m, d, n, k, L, F = 1000, 256, 96, 8, 384, 320
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, d, device="cuda") * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda") * 0.05
    hist, hist_ref = (torch.zeros(n, 1000, dtype=torch.int32, device="cuda") for _ in range(2))
    x1, w1, x2, w2 = leaf(x), leaf(w), leaf(x), leaf(w)
    idx, p = route_fused(x1, w1, bias, k, hist=hist, hist_range=qb_range(bias))
    idx_ref, p_ref = route_reference(x2, w2, bias, k, hist=hist_ref)
    same = _same_selection(idx, idx_ref, x, w, bias)
    assert same.float().mean() > 0.99 and rel(p[same], p_ref[same]) < 1e-5
    assert (hist - hist_ref).abs().sum() <= m * n // 200
    dp = torch.randn(m, k, device="cuda")
    (p[same] * dp[same]).sum().backward()
    (p_ref[same] * dp[same]).sum().backward()
    assert rel(x1.grad, x2.grad) < 2e-2 and rel(w1.grad, w2.grad) < 2e-2
    # SiTU-GLU, packed, bf16
    h = (torch.randn(4097, 2 * F, device="cuda") * 4).to(torch.bfloat16)
    dy = torch.randn(4097, F, device="cuda").to(torch.bfloat16)
    h1, h2 = leaf(h), leaf(h)
    y = situ_fused_packed(h1)
    y_ref = situ_glu_reference(*h2.chunk(2, -1))
    y.backward(dy)
    y_ref.backward(dy)
    assert rel(y, y_ref) < 1e-2 and rel(h1.grad, h2.grad) < 1e-2
    # combine + RMSNorm, bf16
    order, _, _ = sort_by_expert(idx, n)
    yr = torch.randn(m * k, L, device="cuda").to(torch.bfloat16)
    pw = torch.rand(L, device="cuda") + 0.5
    y1, p1, pw1, y2, p2, pw2 = leaf(yr), leaf(p), leaf(pw), leaf(yr), leaf(p), leaf(pw)
    out = combine_norm(y1, order, p1, pw1, 1e-5)
    ref = combine_norm_reference(y2, order, p2, pw2, 1e-5)
    do = torch.randn_like(out)
    out.backward(do)
    ref.backward(do)
    assert rel(out, ref) < 1e-2
    assert rel(y1.grad, y2.grad) < 1e-2 and rel(p1.grad, p2.grad) < 1e-2 and rel(pw1.grad, pw2.grad) < 1e-2


def test_permute_rows_fused_backward_matches_index():
    from k3.ops.moe.combine_triton import permute_rows_fused

    torch.manual_seed(6)
    m, k, E, L = 13, 3, 5, 19
    idx = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(m)])
    order, tok, _ = sort_by_expert(idx, E)
    z = torch.randn(m, L, device=DEV)
    g = torch.randn(m * k, L, device=DEV)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(m * k, device=DEV)
    z1, z2 = leaf(z), leaf(z)
    out = permute_rows_fused(z1, tok, row_of.view(m, k))
    ref = z2[tok]
    out.backward(g)
    ref.backward(g)
    assert torch.equal(out, ref) and rel(z1.grad, z2.grad) < 1e-6


@pytest.mark.parametrize("m, k, E", [(1, 8, 128), (3, 4, 16), (64, 8, 128), (13, 16, 896), (0, 4, 8), (40, 2, 3)])
def test_expert_rows_fused_equals_the_sort(m, k, E):
    """The rank kernel gives the stable sort's layout exactly (row of every entry, token of every row, group ends),
    with ties, empty experts, R not a multiple of the tile and more experts than rows (and the reverse)."""
    from k3.ops.moe.grouped import expert_rows
    from k3.ops.moe.rows_triton import expert_rows_fused

    g = torch.Generator().manual_seed(m * 1000 + k)
    idx = torch.randint(0, E, (m, k), generator=g)
    if m > 1:
        idx[1] = idx[0]  # ties across tokens
    order, tok, offs = sort_by_expert(idx, E)
    row_of, tok_f, offs_f = (t.cpu() for t in expert_rows_fused(idx.to(DEV), E))  # outputs poisoned first
    assert torch.equal(offs_f, offs) and offs_f.dtype == torch.int32
    assert torch.equal(tok_f, tok)
    assert torch.equal(row_of.reshape(-1)[order], torch.arange(m * k))
    ref_row, ref_tok, ref_offs = expert_rows(idx, E)  # the dispatcher's torch path on CPU tensors
    assert torch.equal(ref_row, row_of) and torch.equal(ref_tok, tok) and torch.equal(ref_offs, offs)


def test_fallback_notice_once_per_path(capsys):
    from k3.ops import _fastpath

    _fastpath.fallback_notice("test path", "needs X", "Y")
    _fastpath.fallback_notice("test path", "needs X", "Y")
    assert capsys.readouterr().err == "k3: test path needs X: using Y\n"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_grouped_mm_under_autocast_casts_like_a_matmul(device):
    """bf16 rows × fp32 master experts under autocast (the eager reference trainer): the product and both gradients
    in the autocast dtype's precision, the weight gradient in the weight's dtype (a backward of mixed dtypes fails)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(9, 16, generator=g).to(device)
    b = (torch.randn(3, 16, 8, generator=g) / 4).to(device).requires_grad_(True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32, device=device)  # an empty group, and 2 rows past the last
    dy = torch.randn(9, 8, generator=g).to(device)
    a16 = a.bfloat16().requires_grad_(True)
    y = torch.full((9, 8), float("nan"), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = grouped_mm(a16, b, offs)
    assert y.dtype == torch.bfloat16
    (y[:7].float() * dy[:7]).sum().backward()
    a32 = a.clone().requires_grad_(True)
    b32 = b.detach().clone().requires_grad_(True)
    ref = torch.cat([a32[:2] @ b32[0], a32[2:7] @ b32[2]])
    (ref * dy[:7]).sum().backward()
    assert b.grad.dtype == torch.float32 and a16.grad.dtype == torch.bfloat16
    assert rel(y[:7].float(), ref) < 2e-2 and rel(b.grad, b32.grad) < 2e-2
    assert rel(a16.grad[:7].float(), a32.grad[:7]) < 2e-2


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_router_logits_gradients_with_bf16_activations(device, w_dtype):
    """fp32 logits of bf16 activations × a bf16 weight or an fp32 master weight (the eager autocast trainer): the
    gradients of both in their own dtypes, close to fp32 autograd."""
    g = torch.Generator().manual_seed(0)  # the op is registered by the router_triton import above
    x = torch.randn(7, 32, generator=g).to(device).bfloat16().requires_grad_(True)
    w = (torch.randn(12, 32, generator=g) / 6).to(device).to(w_dtype).requires_grad_(True)
    dl = torch.randn(7, 12, generator=g).to(device)
    y = torch.ops.k3.router_logits(x, w)
    assert y.dtype == torch.float32
    (y * dl).sum().backward()
    x32, w32 = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ((x32 @ w32.t()) * dl).sum().backward()
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    assert rel(y, x32 @ w32.t()) < 1e-2 and rel(x.grad.float(), x32.grad) < 2e-2
    assert rel(w.grad.float(), w32.grad) < 2e-2
