"""The MoE ops as torch.library ops: schema, fake (meta) impls and autograd formulas pass ``opcheck``, and a whole
Latent MoE layer — router with its in-place QB histogram, SiTU-GLU, combine + RMSNorm, the row permutation —
compiles into one graph (``fullgraph=True``) whose outputs, gradients, histogram and loads equal eager's.

CPU: the Triton kernels run in the interpreter (fp32, tiny shapes); ``aot_eager`` traces exactly what inductor
would see, without generating code."""

import copy

import pytest
import torch

from k3.config import K3Config
from k3.layers.moe import LatentMoE
from k3.ops.moe.qb import qb_range
from k3.ops.moe.situ import situ_bound

pytest.importorskip("triton")
import k3.ops.moe.combine_triton  # noqa: E402,F401  (registers the ops)
import k3.ops.moe.router_triton  # noqa: E402,F401
import k3.ops.moe.rows_triton  # noqa: E402,F401
import k3.ops.moe.situ_triton  # noqa: E402,F401

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ops = torch.ops.k3


def _g(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).requires_grad_(True)


def test_moe_ops_pass_opcheck() -> None:
    torch.manual_seed(0)
    m, n, d, k, L, F = 5, 6, 8, 2, 12, 10
    x, w = _g(m, d), _g(n, d)
    logits = torch.randn(m, n, device=DEV)
    bias = torch.randn(n, device=DEV) * 0.1
    torch.library.opcheck(ops.router_logits.default, (x, w))
    torch.library.opcheck(ops.moe_route.default, (logits.clone().requires_grad_(True), bias, k, 1.5))
    lo, span = qb_range(bias)
    for count in (1, 0):  # 0: a checkpointed recompute adds nothing
        hist = torch.zeros(n, 16, dtype=torch.int32, device=DEV)
        torch.library.opcheck(ops.qb_histogram_logits.default, (logits, bias, k, hist, lo, span,
                                                                 torch.full((1,), count, dtype=torch.int32,
                                                                            device=DEV)))
    hist = torch.zeros(n, 16, dtype=torch.int32, device=DEV)
    ops.qb_histogram_logits(logits, bias, k, hist, lo, span, torch.zeros(1, dtype=torch.int32, device=DEV))
    assert int(hist.abs().sum()) == 0
    ops.qb_histogram_logits(logits, bias, k, hist, lo, span, torch.full((1,), 3, dtype=torch.int32, device=DEV))
    assert int(hist.sum()) == 3 * m * n
    b = torch.randn(3, 6, 7, device=DEV).transpose(1, 2)  # the transposed expert views the layer passes
    offs = torch.tensor([2, 2, 5], dtype=torch.int32, device=DEV)
    torch.library.opcheck(ops.grouped_mm_loop.default, (_g(5, 7), b.requires_grad_(True), offs))
    g, u, dy = _g(m, F, scale=3.0), _g(m, F, scale=20.0), torch.randn(m, F, device=DEV)
    torch.library.opcheck(ops.situ_glu.default, (g, u, 4.0, 25.0, situ_bound(4.0, 25.0, g.dtype)))
    torch.library.opcheck(ops.situ_glu_bwd.default, (g.detach(), u.detach(), dy, 4.0, 25.0))
    gu = _g(m, 2 * F, scale=3.0)
    torch.library.opcheck(ops.situ_glu_packed.default, (gu, 4.0, 25.0, situ_bound(4.0, 25.0, gu.dtype)))
    torch.library.opcheck(ops.situ_glu_packed_bwd.default, (gu.detach(), dy, 4.0, 25.0))
    order = torch.randperm(m * k, device=DEV)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(m * k, device=DEV)
    y_rows, p, nw = _g(m * k, L), torch.rand(m, k, device=DEV).requires_grad_(True), _g(L)
    torch.library.opcheck(ops.combine_norm.default, (y_rows, row_of.view(m, k), p, nw, 1e-5))
    out, uu, rstd = ops.combine_norm(y_rows.detach(), row_of.view(m, k), p.detach(), nw.detach(), 1e-5)
    torch.library.opcheck(ops.combine_norm_bwd.default, (torch.randn_like(out), y_rows.detach(), row_of.view(m, k),
                                                         p.detach(), nw.detach(), uu, rstd))
    torch.library.opcheck(ops.rows_sum.default, (torch.randn(m * k, L, device=DEV), row_of.view(m, k), torch.float32))
    torch.library.opcheck(ops.permute_rows.default, (_g(m, L), order // k, row_of.view(m, k)))
    torch.library.opcheck(ops.expert_rows.default, (torch.randint(0, n, (m, k), device=DEV), n))


def _layer_pair(seed: int) -> tuple[K3Config, LatentMoE, LatentMoE, torch.Tensor, torch.Tensor]:
    """A tiny Latent MoE with weights away from their init, an identical copy, an input and an output gradient."""
    torch.manual_seed(seed)
    config = K3Config.from_preset("tiny")
    layer = LatentMoE(config, 1).to(DEV).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 9, config.hidden_size, device=DEV)
    return config, layer, copy.deepcopy(layer), x, torch.randn_like(x)


def test_latent_moe_compiles_in_one_graph_with_its_qb_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_MOE_BACKEND", "triton")
    config, eager, compiled, x, dy = _layer_pair(0)
    outs = []
    for module, fn in ((eager, eager), (compiled, torch.compile(compiled, backend="aot_eager", fullgraph=True))):
        xi = x.clone().requires_grad_(True)
        for _ in range(2):  # twice: the histogram accumulates in place across calls
            y = fn(xi)
            y.backward(dy)
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()},
                     module.gate.qb_hist.clone(), module.last_load.clone()))
    (y0, gx0, gp0, h0, l0), (y1, gx1, gp1, h1, l1) = outs
    assert torch.allclose(y0, y1, atol=1e-5) and torch.allclose(gx0, gx1, atol=1e-5)
    for name in gp0:
        assert (gp0[name] is None) == (gp1[name] is None), name
        if gp0[name] is not None:
            assert torch.allclose(gp0[name], gp1[name], atol=1e-5), name
    assert int(h0.sum()) == 2 * 18 * config.n_experts and torch.equal(h0, h1)  # every token × expert, twice
    assert int(l0.sum()) == 18 * config.top_k and torch.equal(l0, l1)


def test_latent_moe_kernels_equal_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer through its Triton ops (router, rows permutation with its gather-sum backward, SiTU-GLU, combine)
    against the same layer on the PyTorch references: outputs and every gradient."""
    _, ref, fused, x, dy = _layer_pair(1)
    outs = []
    for module, backend in ((ref, "torch"), (fused, "triton")):
        monkeypatch.setenv("K3_MOE_BACKEND", backend)
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    for name, g in gp0.items():
        assert (g is None) == (gp1[name] is None), name
        if g is not None:
            torch.testing.assert_close(gp1[name], g, rtol=1e-4, atol=1e-5, msg=name)
