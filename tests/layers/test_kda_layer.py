"""The KDA layer against an explicit per-token loop (projections, conv taps, L2 norm, bounded gate, β, delta rule,
head-wise RMSNorm, output gate), chunked path == recurrent path, and decode with a state."""

import pytest
import torch

from k3.config import K3Config
from k3.layers.kda import KimiDeltaAttention


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def cfg(**kw) -> K3Config:
    return K3Config.from_preset("tiny", hidden_size=24, kda_num_heads=2, kda_head_dim=8, **kw)


def make_layer(seed: int = 0, **kw) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(cfg(**kw))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.uniform_(-1.0, 1.0)  # zero at init: randomise so the per-head scale is exercised
            elif name == "o_norm.weight":
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0.0, 0.3)
    return layer


def loop_reference(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Everything spelled out per token in fp64 from the layer's weights."""
    P = {n: p.detach().double() for n, p in layer.named_parameters()}
    H, K = layer.num_heads, layer.head_dim
    lb, eps = layer.lower_bound, layer.o_norm.eps
    x = x.double()
    B, T, _ = x.shape
    W = P["q_conv1d.weight"].shape[-1]
    streams = {s: x @ P[f"{s}_proj.weight"].t() for s in "qkv"}  # [B, T, H*K]
    S = torch.zeros(B, H, K, K, dtype=torch.float64)
    out = []
    for t in range(T):
        cur = {}
        for s in "qkv":
            acc = torch.zeros(B, H * K, dtype=torch.float64)
            for j in range(W):
                src = t - (W - 1) + j
                if src >= 0:
                    acc += P[f"{s}_conv1d.weight"][:, 0, j] * streams[s][:, src]
            cur[s] = torch.nn.functional.silu(acc).view(B, H, K)
        q = cur["q"] / (cur["q"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = cur["k"] / (cur["k"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        v = cur["v"]
        f = (x[:, t] @ P["f_a_proj.weight"].t() @ P["f_b_proj.weight"].t()).view(B, H, K)
        z = torch.exp(P["A_log"])[None, :, None] * (f + P["dt_bias"].view(1, H, K))
        g = lb * torch.sigmoid(z)  # log α ∈ (lb, 0)
        beta = torch.sigmoid(x[:, t] @ P["b_proj.weight"].t())  # [B, H]
        o_t = torch.zeros(B, H, K, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                Sd = torch.diag(torch.exp(g[b, h])) @ S[b, h]
                kk = k[b, h][:, None]
                S[b, h] = (torch.eye(K, dtype=torch.float64) - beta[b, h] * kk @ kk.t()) @ Sd \
                    + beta[b, h] * kk @ v[b, h][None, :]
                o_t[b, h] = S[b, h].t() @ (q[b, h] * K**-0.5)
        o_n = o_t / (o_t.pow(2).mean(-1, keepdim=True) + eps).sqrt() * P["o_norm.weight"]
        gate = torch.sigmoid(x[:, t] @ P["g_proj.weight"].t()).view(B, H, K)
        out.append((o_n * gate).reshape(B, H * K) @ P["o_proj.weight"].t())
    return torch.stack(out, 1)


@pytest.mark.parametrize("T", [1, 5, 63, 100])
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_kda_layer_matches_token_loop(T: int, impl: str) -> None:
    layer = make_layer(T)
    layer.impl = impl
    x = torch.randn(2, T, 24)
    assert rel(layer(x), loop_reference(layer, x)) < 1e-5


def test_kda_layer_extremes_gate_at_bound_and_beta_saturated() -> None:
    layer = make_layer(3)
    with torch.no_grad():
        layer.A_log.fill_(6.0)  # exp(A_log)·z huge → g at the bound (−5) or at 0 per channel
        layer.b_proj.weight.mul_(40.0)  # β ≈ 0 or 1
    x = torch.randn(1, 37, 24)
    for impl in ("auto", "reference"):
        layer.impl = impl
        assert rel(layer(x), loop_reference(layer, x)) < 1e-5


def test_kda_lower_bound_from_config() -> None:
    layer = make_layer(4, kda_gate_lower_bound=-2.5)
    assert layer.lower_bound == -2.5
    x = torch.randn(1, 9, 24)
    assert rel(layer(x), loop_reference(layer, x)) < 1e-5


def test_chunked_path_equals_recurrent_path_outputs_and_gradients() -> None:
    layer = make_layer(5)
    x = torch.randn(2, 70, 24)
    grads = {}
    for impl in ("auto", "reference"):
        layer.impl = impl
        xi = x.clone().requires_grad_()
        y = layer(xi)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
        params = dict(layer.named_parameters())
        gs = torch.autograd.grad(y, [xi, *params.values()], gy)
        grads[impl] = (y.detach(), dict(zip(["x", *params], gs)))
    (ya, ga), (yr, gr) = grads["auto"], grads["reference"]
    assert rel(ya, yr) < 1e-5
    for name in gr:
        assert torch.isfinite(ga[name]).all(), name
        assert rel(ga[name], gr[name]) < 1e-4, name


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_kda_decode_state_piecewise_and_token_by_token(impl: str) -> None:
    layer = make_layer(6)
    layer.impl = impl
    x = torch.randn(2, 21, 24)
    with torch.no_grad():
        full = layer(x)
        st = layer.init_state(2, dtype=x.dtype)
        pieces = [layer(x[:, a:b], st) for a, b in [(0, 1), (1, 8), (8, 9), (9, 21)]]
        assert rel(torch.cat(pieces, 1), full) < 1e-5
        st2 = layer.init_state(2, dtype=x.dtype)
        toks = [layer(x[:, t:t + 1], st2) for t in range(21)]
        assert rel(torch.cat(toks, 1), full) < 1e-5
        assert st2.recurrent.dtype == torch.float32 and st2.recurrent.shape == (2, 2, 8, 8)
        assert rel(st2.recurrent, st.recurrent) < 1e-5
        for a, b in zip(st.conv, st2.conv):
            assert a.shape == (2, 3, 16) and rel(a, b) < 1e-6  # projections of the last 3 inputs


def test_kda_parameter_names_shapes_dtypes() -> None:
    layer = KimiDeltaAttention(K3Config.from_preset("tiny", dtype="bfloat16"))
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()}
    H, K, d = 2, 32, 64
    assert shapes["q_conv1d.weight"] == ((H * K, 1, 4), torch.float32)
    assert shapes["A_log"] == ((H,), torch.float32)
    assert shapes["dt_bias"] == ((H * K,), torch.float32)
    assert shapes["o_norm.weight"] == ((K,), torch.float32)
    assert shapes["f_a_proj.weight"][0] == (K, d) and shapes["f_b_proj.weight"][0] == (H * K, K)
    assert shapes["b_proj.weight"][0] == (H, d) and shapes["g_proj.weight"][0] == (H * K, d)
    assert shapes["o_proj.weight"][0] == (d, H * K)
    assert set(shapes) == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                           "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log",
                           "b_proj.weight", "g_proj.weight", "o_norm.weight", "o_proj.weight"}
    dt = torch.nn.functional.softplus(layer.dt_bias)  # init: dt ∈ [1e-3, 1e-1]
    assert (dt > 0.9e-3).all() and (dt < 0.11).all() and (layer.A_log == 0).all()
